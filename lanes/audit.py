"""The audit lane: persists every event before acknowledging it.

Events arriving within `audit.batch_seconds` of the first are written in one transaction and
acknowledged together: a commit (and fsync) a step kept this lane busy 0.6-0.7 ms of CPU a token,
which on a 2-core machine came out of the verify lane's forward. The orchestrator keeps each event
until its acknowledgement comes back, so a crash here loses nothing and a re-sent event is ignored
by its id.
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
BATCH_BUFFER = 8192  # events a batch may gather in the socket (nng's most); more wait in the sender


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
    # While a batch gathers, its events wait in the socket: the orchestrator's sends never block,
    # and one it cannot hand over now is only sent again after `audit.resend_after`.
    inbox: Inbox = Inbox(config.bind("audit"), AuditInbox, config.tls, buffer=BATCH_BUFFER)
    acks = lane.replies()
    lane.heartbeat()
    prune_at = retain(store, lane)
    while True:
        messages = [await inbox.next()]
        if config.audit.batch_seconds > 0:  # the rest of the batch waits in the socket's buffer
            await trio.sleep(config.audit.batch_seconds)
        messages += inbox.ready()
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
