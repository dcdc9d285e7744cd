"""Stop conditions and held-back text in the output stream."""

from __future__ import annotations

import pytest

from pipeline.decoding.output import OutputStream
from pipeline.decoding.sampling import SamplingParams


def feed(tokenizer, params, text, extra=()):
    out = OutputStream(tokenizer, params)
    shown = []
    for token in [*tokenizer.encode(text), *extra]:
        shown.append(out.push(token))
        if out.done:
            break
    return out, shown


def test_stop_string_is_cut_and_never_shown(tiny_tokenizer):
    out, shown = feed(tiny_tokenizer, SamplingParams(stop=("END",)), "hello worENDld")
    assert out.finish_reason == "stop"
    assert "".join(shown) == out.text == "hello wor"
    assert all("E" not in piece for piece in shown)


def test_text_is_streamed_before_the_end(tiny_tokenizer):
    out, shown = feed(tiny_tokenizer, SamplingParams(stop=("xyz",)), "abcdefgh")
    assert not out.done
    assert "".join(shown) == "abcdef"  # the last two characters could start "xyz"
    assert out.finish("length") == "gh"


def test_eos_stops_and_is_not_text(tiny_tokenizer):
    out, _ = feed(tiny_tokenizer, SamplingParams(), "ab", extra=[2, 65])
    assert out.finish_reason == "stop"
    assert out.tokens[-1] == 2 and out.text == "ab"


def test_ignore_eos_keeps_going(tiny_tokenizer):
    out, _ = feed(tiny_tokenizer, SamplingParams(ignore_eos=True), "ab", extra=[2, 65])
    assert not out.done and out.tokens[-2:] == [2, 65]


def test_max_tokens(tiny_tokenizer):
    out, shown = feed(tiny_tokenizer, SamplingParams(max_tokens=3), "abcdef")
    assert out.finish_reason == "length" and len(out.tokens) == 3 and "".join(shown) == "abc"


def test_push_after_finish_is_refused(tiny_tokenizer):
    out, _ = feed(tiny_tokenizer, SamplingParams(max_tokens=1), "ab")
    with pytest.raises(RuntimeError):
        out.push(5)
