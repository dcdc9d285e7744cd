"""What the orchestrator writes down besides the requests themselves: audit events (held in
the outbox until the audit lane acknowledges them), the faults it keeps for `status`, the
speculation totals and the lanes' snapshots. Each also goes into the journal, so an
orchestrator that restarts has the same history and re-sends what was never acknowledged.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable

import msgspec

from pipeline.orchestration.audit_outbox import AuditOutbox
from pipeline.orchestration.effects import Send
from pipeline.orchestration.journal import KEPT_FAULTS, Journal, Recovered, readable
from pipeline.orchestration.lane_table import LaneTable
from pipeline.protocol.config import Audit
from pipeline.protocol.messages import AuditEvent, Fault, FaultEvent, LaneSnapshot, SpeculativeState, encode

FaultCounter = Callable[[str, str], None]  # (kind, lane): the faults metric


def no_count(kind: str, lane: str) -> None:
    """No metrics to count into (a ledger built alone, in tests)."""


class Ledger:
    def __init__(
        self, settings: Audit, lanes: LaneTable, journal: Journal, count_fault: FaultCounter = no_count
    ) -> None:
        self.settings, self.lanes, self.journal = settings, lanes, journal
        self.count_fault = count_fault  # every fault kept here (what `status` lists) is counted, once
        self.outbox = AuditOutbox()
        self.faults: collections.deque[Fault] = collections.deque(maxlen=KEPT_FAULTS)
        self.totals = SpeculativeState()
        self.next_resend = 0.0

    def restore(self, journaled: Recovered) -> None:
        for event_id, data in journaled.outbox:
            self.outbox.add(event_id, data, None)
        self.faults.extend(f for data in journaled.faults if (f := readable(data, Fault)) is not None)
        totals = readable(journaled.state.get("totals", b""), SpeculativeState)
        self.totals = totals if totals is not None else self.totals

    def backlog(self) -> str | None:
        """Why no new request should add to the outbox now, if so."""
        if len(self.outbox) < self.settings.max_pending:
            return None
        return (
            f"the audit lane has {len(self.outbox)} events unacknowledged (audit.max_pending is "
            f"{self.settings.max_pending}); new requests wait until it catches up"
        )

    # --- audit events ------------------------------------------------------------------

    def record(self, event: AuditEvent, now: float) -> list[Send]:
        data, up = encode(event), self.lanes.is_up("audit")
        self.outbox.add(event.event_id, data, now if up else None)
        self.journal.outbox_add(event.event_id, data)
        return [Send("audit", data, (event.event_id,))] if up else []

    def acknowledged(self, event_ids: list[str]) -> None:
        self.outbox.ack(event_ids)
        self.journal.outbox_ack(event_ids)

    def audit_lane_back(self, now: float) -> list[Send]:
        self.outbox.all_unsent()
        return self.resend(now)

    def due(self, now: float) -> list[Send]:
        """Unacknowledged events to send again, checked twice per `resend_after`."""
        if now < self.next_resend:
            return []
        self.next_resend = now + self.settings.resend_after / 2
        return self.resend(now)

    def resend(self, now: float) -> list[Send]:
        if not self.lanes.is_up("audit"):
            return []
        return [
            Send("audit", data, (event_id,))
            for event_id, data in self.outbox.due(now, self.settings.resend_after)
        ]

    # --- faults, totals, snapshots -----------------------------------------------------

    def fault(self, fault: Fault, now: float) -> list[Send]:
        self.faults.append(fault)
        self.count_fault(fault.kind, fault.lane)
        self.journal.fault(msgspec.msgpack.encode(fault))
        event = FaultEvent(
            event_id=f"fault:{uuid.uuid4().hex}", request_id=fault.request_id or "",
            time=fault.time or time.time(), fault=fault,
        )  # fmt: skip
        return self.record(event, now)

    def count_run(self, drafted: int, accepted: int) -> None:
        self.totals.runs += 1
        self.totals.drafted += drafted
        self.totals.accepted += accepted
        self.journal.put_state("totals", msgspec.msgpack.encode(self.totals))

    def snapshot(self, name: str, now: float) -> list[Send]:
        """The lane's heartbeat totals into the audit trail, at most every audit.snapshot_seconds."""
        lane, every = self.lanes[name], self.settings.snapshot_seconds
        if every <= 0 or now - lane.snapshot_at < every:
            return []
        lane.snapshot_at = now
        snapshot = LaneSnapshot(
            event_id=f"lane:{name}:{uuid.uuid4().hex}", request_id="", time=time.time(), lane=name,
            pid=lane.pid, restarts=lane.restarts, lane_state=lane.state,
            totals=self.totals if name == "orchestrator" else lane.totals,
        )  # fmt: skip
        return self.record(snapshot, now)
