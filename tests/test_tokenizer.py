"""Tokenizer round trips, chat templates and streaming decoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model.prompts import prompt_tokens

TEXTS = [
    "日本語のテキスト、中文文本",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "   multiple   spaces\n\n\ttabs\r\n  ",
    "Ελληνικά и русский текст",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def stream_decode(tokenizer, ids):
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    for piece in pieces:
        assert "\ufffd" not in piece  # never half a character
    return "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_tiny(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert stream_decode(tiny_tokenizer, ids) == text


def test_control_tokens_are_single_ids(tiny_tokenizer):
    assert tiny_tokenizer.encode("<|im_start|>x<|im_end|>")[0] == 1
    assert tiny_tokenizer.encode("<|im_start|>x<|im_end|>")[-1] == 2


def test_merges_are_applied(tiny_tokenizer):
    assert len(tiny_tokenizer.encode(" the")) == 1


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_round_trips_and_streams(tiny_tokenizer, text):
    text = text.replace("<|", "< |")  # control-token spellings are ids, not text
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert stream_decode(tiny_tokenizer, ids) == text


def test_streaming_holds_back_partial_characters(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🤖")
    assert len(ids) == 4  # four byte tokens
    stream = tiny_tokenizer.stream()
    assert [stream.push(i) for i in ids] == ["", "", "", "🤖"]


def test_chat_template_and_prompt_modes(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert tiny_tokenizer.render_chat(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat = prompt_tokens(tiny_tokenizer, "hi", chat=True)
    assert chat == prompt_tokens(tiny_tokenizer, None, messages=messages)
    assert prompt_tokens(tiny_tokenizer, "hi") == tiny_tokenizer.encode("hi")
    with pytest.raises(ValueError, match="role"):
        tiny_tokenizer.render_chat([{"role": "user"}])
    with pytest.raises(ValueError, match="not both"):
        prompt_tokens(tiny_tokenizer, "hi", messages=messages)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_default_model(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert stream_decode(tok, ids) == text
