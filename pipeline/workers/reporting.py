"""What a lane core needs of its process: somewhere to report faults, running totals for the
heartbeat, and telemetry. `lanes.lane.LaneContext` is the real one; tests pass a fake."""

from __future__ import annotations

from typing import Literal, Protocol

from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.messages import DraftRequest, FaultKind, Open, SpeculativeState, StepFailed, Verify

Origin = Literal["open", "verify", "draft"]


class LaneReporter(Protocol):
    state: SpeculativeState
    telemetry: Telemetry

    def fault(
        self,
        kind: FaultKind,
        message: str,
        request_id: str | None = None,
        step: int | None = None,
        trace: dict[str, str] | None = None,
    ) -> None: ...


def step_failed(
    reporter: LaneReporter, msg: Open | Verify | DraftRequest, kind: FaultKind, message: str
) -> StepFailed:
    """The reply for a step this lane cannot serve, reported as a fault unless it only means
    "re-prime me" (unknown_request: the orchestrator recovers from it on its own)."""
    if kind != "unknown_request":
        reporter.fault(kind, message, msg.request_id, msg.step, msg.trace)
    origin = origin_of(msg)
    return StepFailed(request_id=msg.request_id, step=msg.step, origin=origin, kind=kind, message=message)


def origin_of(msg: Open | Verify | DraftRequest) -> Origin:
    """Which kind of work a StepFailed answers (its `origin`)."""
    return "open" if isinstance(msg, Open) else "verify" if isinstance(msg, Verify) else "draft"
