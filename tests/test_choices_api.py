"""OpenAI's `n` without processes (api/choices.py): the cap and its 400s, each choice's Submit
(seed S + i, id `<base>-<i>`), and the merged chunks and responses, checked against the `openai`
package's own models so a field the official client would not parse fails here."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pipeline.api import choices
from pipeline.api.chat import ChatFormatter
from pipeline.api.completions import TextFormatter
from pipeline.api.errors import ApiError
from pipeline.decoding.result import Result
from pipeline.observability.request_ids import CHOICE_ID, resolve
from pipeline.protocol.config import load_config

from .api_surfaces import decode_request, to_submit

MODEL = "SmolLM2-135M-Instruct.Q4_1"
BASE = "0123456789abcdef0123456789abcdef"


def submit_of(**fields):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()
    return to_submit(decode_request(body, True), MODEL)


def done(index: int, tokens: list[int], reason: str = "stop") -> Result:
    return msgspec.convert(
        {
            "prompt_tokens": [1, 2, 3], "tokens": tokens, "text": f"choice {index}", "finish_reason": reason,
            "stats": {"drafter": "auto", "steps": len(tokens), "seed": 40 + index},
            "request_id": f"{BASE}-{index}",
        },
        Result,
    )  # fmt: skip


@pytest.mark.parametrize(("n", "count"), [(None, 1), (1, 1), (3, 3), (16, 16)])
def test_n_up_to_the_cap_is_served(n, count):
    assert choices.choice_count(n, 16) == count


@pytest.mark.parametrize(("n", "words"), [(0, "at least 1"), (-2, "at least 1"), (17, "at most 16")])
def test_n_below_one_or_over_the_cap_is_a_400_naming_it(n, words):
    with pytest.raises(ApiError) as caught:
        choices.choice_count(n, 16)
    assert (caught.value.status, caught.value.param) == (400, "n") and words in caught.value.message


def test_the_cap_is_a_setting_and_best_of_stays_refused():
    assert load_config(None, environ={}).gateway.max_choices == 16
    assert load_config(None, ["gateway.max_choices=4"], environ={}).gateway.max_choices == 4
    with pytest.raises(ValueError, match="max_choices"):
        load_config(None, ["gateway.max_choices=0"], environ={})
    body = json.dumps({"model": MODEL, "prompt": "Once", "n": 2, "best_of": 3}).encode()
    with pytest.raises(ApiError) as caught:
        to_submit(decode_request(body, False), MODEL)
    assert caught.value.param == "best_of"


def test_each_choice_is_the_request_with_seed_plus_its_index_and_an_id_of_its_own():
    submit = submit_of(n=3, seed=41, temperature=0.7, max_tokens=9, stop=["END"])
    three = choices.choice_submits(submit, 3, BASE)
    assert [s.params.seed for s in three] == [41, 42, 43]
    assert [s.request_id for s in three] == [f"{BASE}-0", f"{BASE}-1", f"{BASE}-2"]
    assert all(CHOICE_ID.fullmatch(s.request_id) for s in three)
    assert len({s.idempotency_key for s in three}) == 3 and all(s.idempotency_key for s in three)
    for s in three:  # nothing else differs: every setting applies to every choice
        same = msgspec.structs.replace(s, request_id="", idempotency_key="", params=submit.params)
        assert same == msgspec.structs.replace(submit, idempotency_key="")
    assert [s.params.seed for s in choices.choice_submits(submit_of(seed=2**64 - 2), 3, BASE)] == [
        2**64 - 2,
        2**64 - 1,
        0,
    ]
    assert {s.params.seed for s in choices.choice_submits(submit_of(), 2, BASE)} == {
        None
    }  # each draws its own


def test_the_response_id_names_every_choice_and_a_choice_id_names_one():
    ids = [f"{BASE}-{i}" for i in range(3)]
    with pytest.raises(LookupError, match="fits 3 requests"):
        resolve(f"chatcmpl-{BASE}", ids)
    assert resolve(f"chatcmpl-{BASE}-2", ids) == ids[2]


def test_a_whole_response_lists_the_choices_by_index_and_sums_usage():
    results = [done(0, [5, 6, 2]), done(1, [7, 8, 9, 10], "length"), done(2, [2])]
    chat = ChatCompletion.model_validate(choices.response(ChatFormatter(BASE, MODEL, 1, 3), results))
    assert chat.id == f"chatcmpl-{BASE}" and [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == ["choice 0", "choice 1", "choice 2"]
    assert [c.finish_reason for c in chat.choices] == ["stop", "length", "stop"]
    assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (3, 8)
    assert chat.usage.total_tokens == 11
    assert [c.model_extra["speculation"]["request_id"] for c in chat.choices] == [
        r.request_id for r in results
    ]
    assert "speculation" not in (chat.model_extra or {})  # each choice has its own
    text = Completion.model_validate(choices.response(TextFormatter(BASE, MODEL, 1, 3), results))
    assert [(c.index, c.text) for c in text.choices] == [(0, "choice 0"), (1, "choice 1"), (2, "choice 2")]
    assert text.usage is not None and text.usage.completion_tokens == 8


def test_stream_chunks_say_their_choice_and_the_usage_chunk_sums():
    fmt = ChatFormatter(BASE, MODEL, 1, 3)
    results = [done(0, [5, 6]), done(1, [7, 8, 9])]
    chunks = [
        *choices.opening_chunks(fmt, 2), choices.indexed(fmt.text("A"), 1), choices.indexed(fmt.text("B"), 0),
        choices.closing_chunk(fmt, results[1], 1), choices.closing_chunk(fmt, results[0], 0),
        choices.usage_chunk(fmt, results),
    ]  # fmt: skip
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in parsed[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    assert [(c.choices[0].index, c.choices[0].delta.content) for c in parsed[2:4]] == [(1, "A"), (0, "B")]
    assert [(c.choices[0].index, c.choices[0].finish_reason) for c in parsed[4:6]] == [
        (1, "stop"),
        (0, "stop"),
    ]
    assert all(c.usage is None for c in parsed[:6])  # a choice's own usage would pass for the request's
    assert parsed[4].model_extra["speculation"]["request_id"] == f"{BASE}-1"
    last = parsed[6]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (3, 5, 8)
    assert choices.opening_chunks(TextFormatter(BASE, MODEL, 1, 3), 2) == []  # completions: no role
