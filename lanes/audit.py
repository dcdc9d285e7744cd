"""The audit lane: persists every event before acknowledging it.

Events arriving together are written in one transaction and acknowledged together; the
orchestrator keeps each event until its acknowledgement comes back, so a crash here
loses nothing and a re-sent event is ignored by its id.
"""

from __future__ import annotations

import logging
import time

import trio

from pipeline.audit_store import AuditStore
from pipeline.lane import LaneContext, lane_main
from pipeline.messages import AuditAck, AuditInbox, BadMessage
from pipeline.transport import Inbox, Outbox

log = logging.getLogger(__name__)


def retain(store: AuditStore, lane: LaneContext) -> float:
    """Apply the configured retention limits now; returns when to apply them next (monotonic)."""
    audit = lane.config.audit
    deleted = store.prune(max_age_seconds=audit.max_age_days * 86400.0, max_requests=audit.max_requests)
    if deleted:
        log.info("retention: deleted %d requests from the audit store", deleted)
    return time.monotonic() + audit.prune_seconds


async def serve(lane: LaneContext) -> None:
    config = lane.config
    store = AuditStore(config.audit.path)
    inbox: Inbox = Inbox(config.bind("audit"), AuditInbox)
    acks = Outbox(config.addresses.data)
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
        ids = store.add(events)
        lane.state.runs += len(ids)
        try:
            await acks.put(AuditAck(event_ids=ids), timeout=config.timeouts.send)
        except trio.TooSlowError:
            lane.fault("timeout", "the orchestrator did not take an audit acknowledgement")


def main() -> None:
    lane_main("audit", serve)


if __name__ == "__main__":
    main()
