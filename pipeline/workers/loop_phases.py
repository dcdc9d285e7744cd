"""Where the verify lane's time goes: each phase of its loop, timed.

The pipeline decodes more slowly than the in-process decoder it wraps, and the difference is what
the lane does around each forward: its own bookkeeping of the step, reading its inbox, reporting to
the orchestrator, the pause that lets the other processes handle a report, drafting, and the waits
for the orchestrator's acknowledgements (run-ahead) or the draft lane's proposals. The lane sums the seconds
of each phase into its heartbeat totals (`SpeculativeState.loop_seconds`), so `speclanes status` and
`speclanes bench pipeline` show the split per forward on a running pipeline.

A phase's time is exclusive: a report sent while the lane reads its inbox counts as report, not
as checkpoint. Time in no phase (nothing admitted, waiting for a request) is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import StrEnum


class LoopPhase(StrEnum):
    FORWARD = "forward"  # the model's batched forward
    BOOKKEEPING = "bookkeeping"  # the rest of a step: admission, acceptance, each request's next step
    CHECKPOINT = "checkpoint"  # between forwards: the event loop's turn and the inbox read
    DRAFTING = "drafting"  # proposals made here, between forwards (`run.draft_in_verify_lane`)
    DRAFT_WAIT = "draft_wait"  # waiting (`run.batch_window_seconds`) for proposals from the draft lane
    REPORT = "report"  # sending decided steps to the orchestrator and draft requests to the draft lane
    PAUSE = "pause"  # `run.report_pause_seconds` after a report, for the processes that read it
    HELD = "held"  # nothing to run while requests are admitted: run-ahead, or a proposal's deadline


class Stopwatch:
    """Exclusive seconds per phase into `totals`: entering a phase inside another stops the outer
    one's clock until the inner one is left. `phase(None)` times nothing."""

    def __init__(
        self, totals: dict[str, float] | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.totals = {} if totals is None else totals
        self.clock = clock
        self.stack: list[str] = []
        self.mark = clock()
        self._phases = {name: _Phase(self, name) for name in LoopPhase}
        self._nothing = _Phase(self, "")  # entered like a phase, charged nothing

    def phase(self, name: LoopPhase | None) -> _Phase:
        return self._nothing if name is None else self._phases[name]

    def _switch(self, enter: str | None) -> None:
        """Charge the time since the last switch to the phase that was running (none for ""), then
        enter `enter` or, given None, leave."""
        now = self.clock()
        if self.stack and self.stack[-1]:
            top = self.stack[-1]
            self.totals[top] = self.totals.get(top, 0.0) + now - self.mark
        self.mark = now
        if enter is None:
            self.stack.pop()
        else:
            self.stack.append(enter)


class _Phase:
    """A reusable context manager for one phase (a `contextmanager` generator a step costs more)."""

    def __init__(self, watch: Stopwatch, name: str) -> None:
        self.watch, self.name = watch, name

    def __enter__(self) -> None:
        self.watch._switch(self.name)

    def __exit__(self, *exc: object) -> None:
        self.watch._switch(None)


def per_forward(before: Mapping[str, float], after: Mapping[str, float], forwards: int) -> dict[str, float]:
    """Milliseconds a forward in each phase between two totals, in `LoopPhase` order."""
    if forwards <= 0:
        return {}
    return {p.value: 1000 * (after.get(p, 0.0) - before.get(p, 0.0)) / forwards for p in LoopPhase}


def render_split(split: Mapping[str, float]) -> str:
    """`forward 5.41, bookkeeping 0.30, ...` (ms a forward; phases with no time left out)."""
    return ", ".join(f"{name} {ms:.2f}" for name, ms in split.items() if ms >= 0.005) or "no forwards"
