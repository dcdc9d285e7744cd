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

from .acceptance import Decision, Verdict, verify
from .adaptive import KController
from .drafters import EMPTY, Drafter, DraftSource, Proposal
from .model import Runtime
from .output import OutputStream
from .sampling import SamplingParams, make_rng, sample_from, target_probs
from .tokenizer import Tokenizer

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


def check_prompt(model: Runtime, prompt_tokens: Sequence[int]) -> None:
    context = model.cfg.context_length
    if not prompt_tokens:
        raise PromptError("the prompt is empty")
    if len(prompt_tokens) >= context:
        raise PromptError(
            f"the prompt has {len(prompt_tokens)} tokens; the model's context is {context}, "
            "which leaves no room to generate"
        )


def draft_rng(seed: int) -> np.random.Generator:
    """The drafter's own random stream, derived from the request seed. Kept apart from the
    verifier's stream so a drafter in another process draws exactly what it would in-process."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))


class Session:
    """One request's decoding state on the side that owns the accepted tokens: the k
    policy, the output stream, the counters. It holds no model, so the same object drives
    the in-process loop and the orchestrator; their outputs agree by construction."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_length: int,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        *,
        k: int | None = None,
        k_max: int = 16,
        max_iterations: int | None = None,
    ) -> None:
        self.controller = KController(fixed=k, k_max=max(k_max, k or 1))
        self.stats = Stats(self.controller.k_max)
        self.out = OutputStream(tokenizer, params)
        self.params, self.context_length, self.max_iterations = params, context_length, max_iterations
        self.prompt_tokens = list(prompt_tokens)
        self.context = list(prompt_tokens)
        self._ending: str | None = None

    def capacity(self) -> int:
        """KV-cache rows the verifier should reserve up front."""
        wanted = len(self.prompt_tokens) + self.params.max_tokens + self.controller.k_max + 1
        return min(self.context_length, wanted)

    def start(self, first: int) -> str:
        """The token sampled from the prefill; returns the text it releases."""
        self.context.append(first)
        return self.out.push(first)

    def plan(self) -> int | None:
        """How many drafts the next step may verify, or None once the request is over."""
        if self.out.done:
            return None
        if self.max_iterations is not None and self.stats.steps >= self.max_iterations:
            self._ending = "max_iterations_exceeded"
            return None
        room = self.context_length - len(self.context)  # positions left once the pending token is fed
        if room < 0:
            self._ending = "length"
            return None
        return max(0, min(self.controller.choose(), room, self.params.max_tokens - len(self.out.tokens) - 1))

    def finish_text(self) -> str:
        """When `plan` ended the request itself: mark the output finished, flush held-back text."""
        return self.out.finish(self._ending) if self._ending and not self.out.done else ""

    def record(
        self, drafted: int, emitted: Sequence[int], accepted: int, draft_s: float, verify_s: float
    ) -> str:
        """Book one verify pass and push its tokens; returns the text they release."""
        stats, controller = self.stats, self.controller
        stats.record(drafted, accepted)
        stats.verify_seconds += verify_s
        stats.draft_seconds += draft_s
        controller.costs.observe_verify(drafted + 1, verify_s)
        controller.costs.observe_draft(drafted, draft_s)
        controller.observe(drafted, accepted)
        text = []
        for token in emitted:
            text.append(self.out.push(token))
            if self.out.done:
                break
        self.context.extend(emitted)
        return "".join(text)

    def completion(self, *, wall: float, prefill_seconds: float, seed: int, drafter: str) -> Completion:
        out = self.out
        return Completion(
            prompt_tokens=self.prompt_tokens,
            tokens=out.tokens,
            text=out.text,
            finish_reason=out.finish_reason or "length",
            stats={
                "wall_seconds": wall,
                "prefill_seconds": prefill_seconds,
                "tokens_per_second": len(out.tokens) / wall if wall > 0 else 0.0,
                "seed": seed,
                "drafter": drafter,
                **self.stats.as_dict(),
            },
        )


class TargetState:
    """One request's state on the side that holds the target model: its KV cache and the
    verifier's random stream. `draws` counts the uniforms spent, so a restarted verifier
    can resume the same stream (`PCG64.advance`) and keep a seeded request reproducible."""

    def __init__(
        self, model: Runtime, params: SamplingParams, seed: int, *, draws: int = 0, capacity: int
    ) -> None:
        self.model, self.params, self.seed = model, params, seed
        bits = np.random.PCG64(seed)
        bits.advance(draws)
        self.rng, self.draws = np.random.Generator(bits), draws
        self.cache = model.new_cache(capacity=capacity)

    def prefill(self, tokens: Sequence[int], *, sample: bool = True) -> tuple[int | None, float | None]:
        """Feed `tokens`; sample the next token from the last position if asked."""
        logits = self.model.forward(self.cache, tokens, all_logits=False)
        return self.first_token(logits[0]) if sample else (None, None)

    def first_token(self, last_logits: np.ndarray) -> tuple[int, float | None]:
        """The token after the prompt, from the prompt's last logits row (fed whole or in chunks)."""
        token, u = sample_from(target_probs(last_logits, self.params), self.rng)
        self.draws += u is not None
        return token, u

    def conclude(self, logits: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None) -> Verdict:
        """Apply the acceptance rule to a forward over [pending, *drafts] and roll back."""
        verdict = verify(drafts, draft_probs, target_probs(logits, self.params), self.rng)
        self.cache.truncate(self.cache.length - len(drafts) + verdict.accepted)
        self.draws += sum(d.u is not None for d in verdict.decisions) + (verdict.final_u is not None)
        return verdict


def decode(
    model: Runtime,
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
    _, seed = make_rng(params.seed)
    session = Session(
        model.tokenizer, model.cfg.context_length, prompt_tokens, params,
        k=k, k_max=k_max, max_iterations=max_iterations,
    )  # fmt: skip
    target = TargetState(model, params, seed, capacity=session.capacity())
    drafter = GuardedDrafter(source.start(prompt_tokens, params, draft_rng(seed)))
    emit = on_text or (lambda _text: None)

    start = time.perf_counter()
    first, _ = target.prefill(prompt_tokens)
    assert first is not None
    prefill_seconds = time.perf_counter() - start
    emit(session.start(first))
    while (want := session.plan()) is not None:
        context = session.context
        t0 = time.perf_counter()
        proposal = drafter.propose(context, want)
        draft_seconds = time.perf_counter() - t0
        drafted = proposal.tokens[:want]
        probs = None if proposal.probs is None else proposal.probs[: len(drafted)]

        t0 = time.perf_counter()
        logits = model.forward(target.cache, [context[-1], *drafted])
        verdict = target.conclude(logits, drafted, probs)
        verify_seconds = time.perf_counter() - t0
        emit(session.record(len(drafted), verdict.tokens, verdict.accepted, draft_seconds, verify_seconds))
        if on_step is not None:
            on_step(
                StepRecord(
                    session.stats.steps,
                    proposal.drafter or drafter.name,
                    drafted,
                    verdict.tokens,
                    verdict.decisions,
                    verdict.final_u,
                )
            )
        drafter.accept(session.context)
    emit(session.finish_text())

    wall = time.perf_counter() - start
    drafter.finish([*prompt_tokens, *session.out.tokens])
    session.stats.draft_failures = drafter.failures
    return session.completion(wall=wall, prefill_seconds=prefill_seconds, seed=seed, drafter=source.name)


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
