"""The pipeline's health from the lanes `status` reports: the one rule behind the gateway's
/health and `speclanes status`. Pure, so it is tested without processes.

Requests are served while the orchestrator and the verify lane are up, even with a draft,
audit or gateway lane failed (degraded: plain decoding, events held in the orchestrator).
Health is stricter: a failed lane (past the restart intensity, never restarted again) needs
someone to look, so /health answers 503 and names it with its own last error line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.protocol.config import ESSENTIAL
from pipeline.protocol.messages import LaneStatus


@dataclass(frozen=True)
class Health:
    not_serving: str | None = None  # why no request can be served now (None: they are, maybe degraded)
    failed: dict[str, str] = field(default_factory=dict)  # each failed lane: its own last error line
    draining: bool = False  # not serving because it is shutting down: a client should retry elsewhere
    storage_full: bool = False  # not serving because the disk is full: a client may retry later

    def reason(self) -> str | None:
        """Why /health answers 503, or None for 200."""
        problems = [self.not_serving] if self.not_serving else []
        problems += [f"the {name} lane failed: {why}" for name, why in self.failed.items()]
        return "; ".join(problems) or None

    def body(self) -> dict[str, object]:
        """What /health and `status --json` say: the status and, if not ok, the reason and failed lanes."""
        reason = self.reason()
        if reason is None:
            return {"status": "ok"}
        return {"status": "unavailable", "reason": reason} | ({"failed": self.failed} if self.failed else {})


def judge(lanes: Sequence[LaneStatus], closing: str = "", storage: str = "") -> Health:
    failed = {lane.name: lane.reason for lane in lanes if lane.state == "failed"}
    down = [lane.name for lane in lanes if lane.name in ESSENTIAL and lane.state != "up"]
    if closing:  # in-flight requests still finish; nothing new is admitted
        return Health(f"draining: the pipeline is shutting down ({closing})", failed, draining=True)
    if storage:  # in-flight requests go on while they can be recorded; nothing new is admitted
        return Health(storage, failed, storage_full=True)
    return Health(f"the pipeline is not ready (not up: {', '.join(down)})" if down else None, failed)


def unreachable(why: str) -> Health:
    return Health(f"the pipeline's orchestrator does not answer ({why})")
