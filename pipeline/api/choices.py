"""OpenAI's `n` as pure functions: one HTTP request, n choices, each a whole pipeline request.

- **Ids.** The response's id is `chatcmpl-<base>` (or `cmpl-<base>`) for a fresh base of 32 hex
  digits; choice i is the pipeline request `<base>-<i>` (its Submit asks for that id). So
  `speclanes audit show|verify` and `speclanes trace` take `chatcmpl-<base>-<i>`, and the response
  id alone fits every choice and lists them. Each choice's stats name its request id.
- **Seeds.** With `seed` S, choice i is decoded with seed (S + i) mod 2^64: exactly the single
  request with that seed (seeded output does not depend on speculation). Without a seed each choice
  gets a fresh one of its own (its stats report it). Greedy choices are all the same text.
- **The prompt is prefilled once**: the verify lane copies its K/V for the other choices
  (`workers/prefix_reuse.py`) while the first is in the lane.
- **Wire format.** Streamed chunks say which choice they belong to in `choices[0].index`,
  interleaved as the choices are decided; a choice's closing chunk carries its `finish_reason`
  and its `speculation` stats. A whole response lists the choices by index, each with its own
  `speculation`. `usage` counts the prompt once and sums the choices' completion tokens.
- **Lifetimes** are the gateway's (`api/fanout.py`): a client that leaves, or one choice that
  fails, cancels every choice.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from pipeline.api.core import Formatter
from pipeline.api.errors import ApiError
from pipeline.decoding.result import Result
from pipeline.observability.request_ids import choice_id
from pipeline.protocol.messages import Submit

SEEDS = 2**64  # SamplingParams' seed range: choice seeds wrap around it


def choice_count(n: int | None, cap: int) -> int:
    """How many choices a request asks for (1 if it names none), within gateway.max_choices."""
    count = 1 if n is None else n
    if count < 1:
        raise ApiError(400, f"n must be at least 1, got {count}", param="n")
    if count > cap:
        raise ApiError(
            400, f"n must be at most {cap} on this server (gateway.max_choices), got {count}", param="n"
        )
    return count


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's seed plus the index, or None (a fresh one each)."""
    return None if seed is None else (seed + index) % SEEDS


def choice_submits(submit: Submit, n: int, base: str) -> list[Submit]:
    """The n pipeline requests behind one request: same prompt and settings, their own seeds,
    ids and idempotency keys."""
    return [
        msgspec.structs.replace(
            submit,
            params=msgspec.structs.replace(submit.params, seed=choice_seed(submit.params.seed, i)),
            request_id=choice_id(base, i),
            idempotency_key=uuid.uuid4().hex,
        )
        for i in range(n)
    ]


def indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """A formatted chunk or response whose one choice is choice `index`."""
    return chunk | {"choices": [choice | {"index": index} for choice in chunk["choices"]]}


def total_usage(results: list[Result], prompt_tokens: int) -> dict[str, int]:
    """The prompt once, every choice's completion tokens."""
    completion = sum(len(done.tokens) for done in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def opening_chunks(fmt: Formatter, n: int) -> list[dict[str, Any]]:
    """Chat streams open each choice with the assistant's role."""
    opening = fmt.opening()
    return [] if opening is None else [indexed(opening, i) for i in range(n)]


def closing_chunk(fmt: Formatter, done: Result, index: int) -> dict[str, Any]:
    """Choice `index`'s last chunk: its finish_reason and stats, no usage (that comes with
    include_usage, summed over the choices)."""
    return indexed(fmt.closing(done), index)


def usage_chunk(fmt: Formatter, results: list[Result]) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, no choices, the summed usage."""
    return fmt.usage_chunk(results[0]) | {"usage": total_usage(results, fmt.prompt_tokens)}


def response(fmt: Formatter, results: list[Result]) -> dict[str, Any]:
    """The whole response: the choices by index, each with its own `speculation` stats."""
    bodies = [fmt.response(done) for done in results]
    choices = [
        choice | {"index": i, "speculation": body["speculation"]}
        for i, body in enumerate(bodies)
        for choice in body["choices"]
    ]
    whole = {key: value for key, value in bodies[0].items() if key != "speculation"}
    return whole | {"choices": choices, "usage": total_usage(results, fmt.prompt_tokens)}
