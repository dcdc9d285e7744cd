"""The speculative step loop, in-process: prefill once, then draft -> verify -> accept ->
roll back -> emit until a stop condition. With no drafter every step verifies zero
drafts, which is plain decoding: the same code path is the reference and the speed-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from .acceptance import Decision, verify
from .adaptive import KController
from .drafters import EMPTY, Drafter, DraftSource, Proposal
from .model import Model
from .output import OutputStream
from .sampling import SamplingParams, make_rng, sample_from, target_probs

log = logging.getLogger(__name__)


class Completion(msgspec.Struct):
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    stats: dict[str, object]


class PromptError(ValueError):
    """A prompt the model cannot take (empty, or filling the whole context)."""


class StepRecord(msgspec.Struct, frozen=True):
    """One verify pass, for the audit trail and for tests."""

    step: int
    drafter: str
    drafted: list[int]
    emitted: list[int]
    decisions: list[Decision]
    final_u: float | None


class Stats:
    """Per-request counters; `as_dict` gives the figures the CLI and benchmarks report."""

    def __init__(self, k_max: int) -> None:
        self.steps = self.drafted = self.accepted = self.draft_failures = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.position_drafted = np.zeros(k_max, np.int64)
        self.position_accepted = np.zeros(k_max, np.int64)

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.position_drafted[:drafted] += 1
        self.position_accepted[:accepted] += 1

    def as_dict(self) -> dict[str, object]:
        used = int(np.flatnonzero(self.position_drafted)[-1]) + 1 if self.drafted else 0
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
            "per_position_acceptance": (
                self.position_accepted[:used] / np.maximum(self.position_drafted[:used], 1)
            ).tolist(),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "draft_failures": self.draft_failures,
        }


def check_prompt(model: Model, prompt_tokens: Sequence[int]) -> None:
    context = model.cfg.context_length
    if not prompt_tokens:
        raise PromptError("the prompt is empty")
    if len(prompt_tokens) >= context:
        raise PromptError(
            f"the prompt has {len(prompt_tokens)} tokens; the model's context is {context}, "
            "which leaves no room to generate"
        )


def decode(
    model: Model,
    prompt_tokens: Sequence[int],
    params: SamplingParams,
    source: DraftSource,
    *,
    k: int | None = None,
    k_max: int = 16,
    max_iterations: int | None = None,
    on_text: Callable[[str], None] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> Completion:
    """Generate with speculation; `k=None` lets the adaptive controller choose k each step."""
    check_prompt(model, prompt_tokens)
    assert model.tokenizer is not None
    controller = KController(fixed=k, k_max=max(k_max, k or 1))
    rng, seed = make_rng(params.seed)
    out = OutputStream(model.tokenizer, params)
    stats = Stats(controller.k_max)
    drafter = GuardedDrafter(source.start(prompt_tokens, params, rng))
    emit = on_text or (lambda _text: None)
    context_limit = model.cfg.context_length
    cache = model.new_cache(capacity=min(context_limit, len(prompt_tokens) + params.max_tokens + k_max + 1))

    start = time.perf_counter()
    logits = model.forward(cache, prompt_tokens, all_logits=False)
    prefill_seconds = time.perf_counter() - start
    first, _ = sample_from(target_probs(logits[0], params), rng)
    context = [*prompt_tokens, first]
    emit(out.push(first))
    while not out.done:
        if max_iterations is not None and stats.steps >= max_iterations:
            emit(out.finish("max_iterations_exceeded"))
            break
        room = context_limit - cache.length - 1  # positions left once the pending token is fed
        if room < 0:
            emit(out.finish("length"))
            break
        want = min(controller.choose(), room, params.max_tokens - len(out.tokens) - 1)
        t0 = time.perf_counter()
        proposal = drafter.propose(context, want)
        draft_seconds = time.perf_counter() - t0
        drafted = proposal.tokens[:want]
        probs = None if proposal.probs is None else proposal.probs[: len(drafted)]

        t0 = time.perf_counter()
        logits = model.forward(cache, [context[-1], *drafted])
        verdict = verify(drafted, probs, target_probs(logits, params), rng)
        verify_seconds = time.perf_counter() - t0
        cache.truncate(cache.length - len(drafted) + verdict.accepted)

        stats.record(len(drafted), verdict.accepted)
        stats.verify_seconds += verify_seconds
        stats.draft_seconds += draft_seconds
        controller.costs.observe_verify(len(drafted) + 1, verify_seconds)
        controller.costs.observe_draft(len(drafted), draft_seconds)
        controller.observe(len(drafted), verdict.accepted)
        if on_step is not None:
            on_step(
                StepRecord(
                    stats.steps,
                    proposal.drafter or drafter.name,
                    drafted,
                    verdict.tokens,
                    verdict.decisions,
                    verdict.final_u,
                )
            )
        for token in verdict.tokens:
            emit(out.push(token))
            if out.done:
                break
        context.extend(verdict.tokens)
        drafter.accept(context)

    wall = time.perf_counter() - start
    drafter.finish([*prompt_tokens, *out.tokens])
    stats.draft_failures = drafter.failures
    return Completion(
        prompt_tokens=list(prompt_tokens),
        tokens=out.tokens,
        text=out.text,
        finish_reason=out.finish_reason or "length",
        stats={
            "wall_seconds": wall,
            "prefill_seconds": prefill_seconds,
            "tokens_per_second": len(out.tokens) / wall if wall > 0 else 0.0,
            "seed": seed,
            "drafter": source.name,
            **stats.as_dict(),
        },
    )


class GuardedDrafter:
    """A drafter whose failures cost speed, never the request: after its first exception
    (logged and counted) it proposes nothing, so the request goes on as plain decoding."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.name, self.failures = drafter, drafter.name, 0

    def _call(self, method: str, *args: object) -> object:
        if self.failures:
            return None
        try:
            return getattr(self.drafter, method)(*args)
        except Exception:
            log.exception("drafter %s failed in %s; continuing without speculation", self.name, method)
            self.failures += 1
            return None

    def propose(self, context: list[int], k: int) -> Proposal:
        proposal = self._call("propose", context, k) if k > 0 else None
        return proposal if isinstance(proposal, Proposal) else EMPTY

    def accept(self, context: list[int]) -> None:
        self._call("accept", context)

    def finish(self, context: list[int]) -> None:
        self._call("finish", context)
