"""The speculative step loop, in-process: prefill once, then draft -> verify -> accept ->
roll back -> emit until a stop condition. With no drafter every step verifies zero
drafts, which is plain decoding: the same code path is the reference and the speed-up.
The pipeline runs the same `Session` and `TargetState` split across processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict
from pipeline.decoding.controls import vocabulary_problem
from pipeline.decoding.drafters import EMPTY, Drafter, DraftSource, Proposal
from pipeline.decoding.grammar.drafting import forced_first
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams, request_seed
from pipeline.decoding.session import Session, check_prompt
from pipeline.decoding.speculation import Speculation
from pipeline.decoding.target import TargetState
from pipeline.model import Runtime
from pipeline.model.calibration import row_seconds

log = logging.getLogger(__name__)

StepObserver = Callable[[int, Proposal, Verdict, int], None]  # (k, what was verified, verdict, draws)


def decode(
    model: Runtime,
    prompt_tokens: Sequence[int],
    params: SamplingParams,
    source: DraftSource,
    *,
    k: int | None = None,
    k_max: int = 16,
    max_iterations: int | None = None,
    tree: bool = True,
    on_text: Callable[[str], None] | None = None,
    on_step: StepObserver | None = None,
) -> Result:
    """Generate with speculation; `k=None` lets the cost-model controller choose how many draft
    nodes to verify each step, `tree=False` asks the drafters for one linear draft a step.
    The drafter is `source` (k, k_max and max_iterations are checked as `Speculation` checks them).
    `on_step` sees every step as it is decided (the prefill as step 0), as the audit trail does."""
    speculation = Speculation(
        k="auto" if k is None else k, k_max=k_max, max_iterations=max_iterations, tree=tree
    )
    check_prompt(prompt_tokens, model.cfg.context_length)
    if (problem := vocabulary_problem(params, model.cfg.vocab_size)) is not None or model.tokenizer is None:
        raise ValueError(problem or "the model has no tokenizer")
    seed = request_seed(params.seed)
    session = Session(model.tokenizer, model.cfg.context_length, prompt_tokens, params, speculation)
    if speculation.fixed_k is None:
        session.controller.costs.calibrate(row_seconds(model))
    features = getattr(source, "needs_features", False)  # a learned drafter reads the target's features
    target = TargetState(model, params, seed, capacity=session.capacity(), keep_features=features)
    drafter = GuardedDrafter(forced_first(source.start(prompt_tokens, params, seed), target.grammar))
    emit = on_text or (lambda _text: None)

    start = time.perf_counter()
    first, u = target.prefill(prompt_tokens)
    assert first is not None
    prefill_seconds = time.perf_counter() - start
    observe = on_step or (lambda *_: None)
    observe(0, EMPTY, Verdict([first], 0, [], u), target.draws)
    drafter.observe(target.features_at, target.features)
    emit(session.start(first, target.logprobs))
    while (want := session.plan()) is not None:
        context = session.context
        t0 = time.perf_counter()
        # The controller's cut, then the grammar's (nodes it forbids would be rejected: never run).
        proposal = drafter.propose(context, want, speculation.tree, session.floor())
        draft = target.constrain(session.cut(proposal, want))
        draft_seconds = time.perf_counter() - t0

        t0 = time.perf_counter()
        verdict = target.step(context[-1], draft)
        emit(session.record_draft(draft, verdict, draft_seconds, time.perf_counter() - t0, target.logprobs))
        observe(want, draft, verdict, target.draws)
        drafter.observe(target.features_at, target.features)
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

    def propose(self, context: list[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        proposal = self._call("propose", context, k, tree, floor) if k > 0 else None
        return proposal if isinstance(proposal, Proposal) else EMPTY

    def accept(self, context: list[int]) -> None:
        self._call("accept", context)

    def observe(self, position: int, features: np.ndarray | None) -> None:
        """The target's features from `position` on, for a drafter that reads them (`drafters.observe`)."""
        if features is not None and hasattr(self.drafter, "observe"):
            self._call("observe", position, features)

    def finish(self, context: list[int]) -> None:
        self._call("finish", context)
