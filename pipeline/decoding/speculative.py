"""The speculative step loop, in-process: prefill once, then draft -> verify -> accept ->
roll back -> emit until a stop condition. With no drafter every step verifies zero
drafts, which is plain decoding: the same code path is the reference and the speed-up.
The pipeline runs the same `Session` and `TargetState` split across processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pipeline.decoding.controls import vocabulary_problem
from pipeline.decoding.drafters import EMPTY, Drafter, DraftSource, Proposal
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams, request_seed
from pipeline.decoding.session import Session, check_prompt
from pipeline.decoding.speculation import Speculation
from pipeline.decoding.target import TargetState
from pipeline.model import Runtime

log = logging.getLogger(__name__)


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
) -> Result:
    """Generate with speculation; `k=None` lets the adaptive controller choose k each step.
    The drafter is `source` (k, k_max and max_iterations are checked as `Speculation` checks them)."""
    speculation = Speculation(k="auto" if k is None else k, k_max=k_max, max_iterations=max_iterations)
    check_prompt(prompt_tokens, model.cfg.context_length)
    if (problem := vocabulary_problem(params, model.cfg.vocab_size)) is not None:
        raise ValueError(problem)
    assert model.tokenizer is not None
    seed = request_seed(params.seed)
    session = Session(model.tokenizer, model.cfg.context_length, prompt_tokens, params, speculation)
    target = TargetState(model, params, seed, capacity=session.capacity())
    drafter = GuardedDrafter(source.start(prompt_tokens, params, seed))
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
        verdict = target.conclude(logits, drafted, probs, pending=context[-1])
        verify_seconds = time.perf_counter() - t0
        emit(session.record(len(drafted), verdict.tokens, verdict.accepted, draft_seconds, verify_seconds))
        drafter.accept(session.context)
    emit(session.finish_text())

    wall = time.perf_counter() - start
    drafter.finish([*prompt_tokens, *session.out.tokens])
    session.stats.draft_failures = drafter.failures
    return session.result(wall=wall, prefill_seconds=prefill_seconds, seed=seed, drafter=source.name)


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
