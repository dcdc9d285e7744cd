"""The audit lane: persists every event before acknowledging it.

Events arriving together are written in one transaction and acknowledged together; the
orchestrator keeps each event until its acknowledgement comes back, so a crash here
loses nothing and a re-sent event is ignored by its id.
"""

from __future__ import annotations

import logging
import time

import trio

from lanes.lane import LaneContext, lane_main
from pipeline.audit.store import AuditStore
from pipeline.protocol.messages import AuditAck, AuditEvent, AuditInbox, BadMessage
from pipeline.protocol.transport import Inbox

log = logging.getLogger(__name__)


def retain(store: AuditStore, lane: LaneContext) -> float:
    """Apply the configured retention limits now; returns when to apply them next (monotonic)."""
    audit = lane.config.audit
    deleted = store.prune(max_age_seconds=audit.max_age_days * 86400.0, max_requests=audit.max_requests)
    if deleted:
        log.info("retention: deleted %d requests from the audit store", deleted)
    return time.monotonic() + audit.prune_seconds


def trace_persisted(lane: LaneContext, events: list[AuditEvent], start_ns: int) -> None:
    """One span per request and write, in the request's own trace: a trace shows when its
    decisions became durable. Events of no request (lane snapshots) get no span."""
    by_request: dict[str, list[AuditEvent]] = {}
    for event in events:
        if event.trace:
            by_request.setdefault(event.request_id, []).append(event)
    for request_id, mine in by_request.items():
        attributes = {
            "speclanes.request_id": request_id, "speclanes.events": len(mine),
            "speclanes.event_types": sorted({type(e).__name__ for e in mine}),
        }  # fmt: skip
        lane.telemetry.start("audit persist", mine[0].trace, attributes, start_time=start_ns).end()


async def serve(lane: LaneContext) -> None:
    config = lane.config
    store = AuditStore(config.audit.path)
    inbox: Inbox = Inbox(config.bind("audit"), AuditInbox, config.tls)
    acks = lane.replies()
    lane.heartbeat()
    prune_at = retain(store, lane)
    while True:
        messages = [await inbox.next(), *inbox.ready()]
        if time.monotonic() >= prune_at:  # events (heartbeat snapshots at least) keep arriving
            prune_at = retain(store, lane)
        events = []
        for msg in messages:
            if isinstance(msg, BadMessage):
                lane.fault("bad_request", str(msg))
            else:
                events.append(msg)
        if not events:
            continue
        start_ns = time.time_ns()
        ids = store.add(events)
        trace_persisted(lane, events, start_ns)
        lane.state.runs += len(ids)
        try:
            await acks.put(AuditAck(event_ids=ids), timeout=config.timeouts.send)
        except trio.TooSlowError:
            lane.fault("timeout", "the orchestrator did not take an audit acknowledgement")


def main() -> None:
    lane_main("audit", serve)


if __name__ == "__main__":
    main()
