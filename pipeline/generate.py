"""Plain (non-speculative) generation in-process: the reference every speed-up must match."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from .model import Model
from .output import OutputStream
from .sampling import SamplingParams, make_rng, sample


class Completion(msgspec.Struct):
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    stats: dict[str, float]


class PromptError(ValueError):
    """A prompt the model cannot take (empty, or longer than its context)."""


def check_prompt(model: Model, prompt_tokens: Sequence[int]) -> None:
    context = model.cfg.context_length
    if not prompt_tokens:
        raise PromptError("the prompt is empty")
    if len(prompt_tokens) >= context:
        raise PromptError(
            f"the prompt has {len(prompt_tokens)} tokens; the model's context is {context}, "
            "which leaves no room to generate"
        )


def generate(
    model: Model,
    prompt_tokens: Sequence[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    """Decode token by token; `on_text` receives text as soon as it is final."""
    check_prompt(model, prompt_tokens)
    assert model.tokenizer is not None
    rng, _ = make_rng(params.seed)
    out = OutputStream(model.tokenizer, params)
    budget = min(model.cfg.context_length, len(prompt_tokens) + params.max_tokens)
    cache = model.new_cache(capacity=budget)
    emit = on_text or (lambda _text: None)

    start = time.perf_counter()
    logits = model.forward(cache, prompt_tokens, all_logits=False)[-1]
    prefill_seconds = time.perf_counter() - start
    while True:
        token = sample(logits, params, rng)
        emit(out.push(token))
        if out.done:
            break
        if cache.length >= model.cfg.context_length:
            emit(out.finish("length"))
            break
        logits = model.forward(cache, [token])[-1]
    wall = time.perf_counter() - start
    return Completion(
        prompt_tokens=list(prompt_tokens),
        tokens=out.tokens,
        text=out.text,
        finish_reason=out.finish_reason or "length",
        stats={
            "wall_seconds": wall,
            "prefill_seconds": prefill_seconds,
            "tokens_per_second": len(out.tokens) / wall if wall > 0 else 0.0,
        },
    )
