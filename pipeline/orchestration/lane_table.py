"""What the orchestrator knows of each lane: state, pid, restarts, totals, runtime, process figures.

Fed by the control lane (the supervisor's LaneUp/LaneDown/LaneFailed, each lane's Heartbeat); read
by request machines (is the verify lane up) and by `status`.
A heartbeat from a pid already reported dead is ignored: it was in flight when it died. A failed
lane (past the restart intensity) stays failed: the supervisor starts no other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.observability.process_stats import ProcessStats
from pipeline.protocol.messages import Heartbeat, LaneDown, LaneFailed, LaneStatus, LaneUp, SpeculativeState

LANES = ("verify", "draft", "audit", "orchestrator")


@dataclass
class LaneView:
    name: str
    state: str = "starting"  # starting | up | stalled | down | failed
    pid: int | None = None
    restarts: int = 0
    totals: SpeculativeState = field(default_factory=SpeculativeState)
    last_beat: float = -math.inf
    dead_pids: set[int] = field(default_factory=set)
    runtime: dict[str, Any] = field(default_factory=dict)
    snapshot_at: float = -math.inf  # when its totals last went to the audit trail
    reason: str = ""  # why it failed: its own last error line
    process: ProcessStats | None = None  # its last heartbeat's; None once the process is gone

    def status(self) -> LaneStatus:
        return LaneStatus(
            name=self.name, state=self.state, pid=self.pid, restarts=self.restarts,
            active_requests=self.totals.active_requests, totals=self.totals, runtime=self.runtime,
            reason=self.reason, process=self.process,
        )  # fmt: skip


Change = Literal["ignored", "beat", "came_up", "went_down", "failed"]


class LaneTable:
    def __init__(self, names: tuple[str, ...] = LANES) -> None:
        self.views = {name: LaneView(name) for name in names}

    def __getitem__(self, name: str) -> LaneView:
        return self.views[name]

    def is_up(self, name: str) -> bool:
        return name in self.views and self.views[name].state == "up"

    def update(self, msg: LaneUp | LaneDown | LaneFailed | Heartbeat, now: float) -> Change:
        if msg.lane == "gateway":
            self.views.setdefault("gateway", LaneView("gateway"))  # possibly one on another host
        lane = self.views.get(msg.lane)
        if lane is None or (lane.state == "failed" and msg.pid in lane.dead_pids):
            return "ignored"  # a failure repeated, or news of the process that failed
        if isinstance(msg, LaneFailed):
            lane.dead_pids.add(msg.pid)
            lane.state, lane.restarts, lane.reason = "failed", msg.restarts, msg.reason
            lane.process = None
            return "failed"
        if msg.pid in lane.dead_pids:  # news of a process already dead: a late heartbeat, a LaneUp
            return "ignored"  # re-announced before it died, its death told twice
        if isinstance(msg, LaneUp):
            if msg.pid != lane.pid:
                lane.process = None  # a new process: the old one's figures are not its own
            lane.pid, lane.restarts, lane.reason = msg.pid, msg.restarts, ""
            if lane.state != "up":
                lane.state = "starting"
            return "beat"
        if isinstance(msg, LaneDown):
            lane.dead_pids.add(msg.pid)
            lane.state, lane.restarts, lane.process = "down", msg.restarts, None
            return "went_down"
        came_up = lane.state != "up"
        lane.state, lane.pid, lane.totals, lane.last_beat = "up", msg.pid, msg.state, now
        # A new process (another host's supervisor started it) clears a failure.
        lane.runtime, lane.reason, lane.process = msg.runtime, "", msg.process
        return "came_up" if came_up else "beat"

    def stalled(self, now: float, hang_seconds: float) -> list[str]:
        """Lanes up but silent for `hang_seconds`, now marked "stalled" (the supervisor kills and
        restarts them; a heartbeat brings one back). The orchestrator's own beats are not watched."""
        if hang_seconds <= 0:
            return []
        silent = [
            lane for lane in self.views.values()
            if lane.state == "up" and lane.name != "orchestrator" and now - lane.last_beat > hang_seconds
        ]  # fmt: skip
        for lane in silent:
            lane.state = "stalled"
        return [lane.name for lane in silent]

    def statuses(self) -> list[LaneStatus]:
        return [lane.status() for lane in self.views.values()]
