"""The audit lane: persists every event before acknowledging it.

The orchestrator holds the events it records for `audit.batch_seconds` and sends them as one
AuditBatch. Whatever is queued when this lane wakes is written in one transaction and acknowledged
together, in one AuditAck sent only after that commit: a commit (and fsync) a step kept this lane
busy 0.6-0.7 ms of CPU a token, which on a 2-core machine came out of the verify lane's forward.
The window is the sender's, not this lane's: a lane that waited for more after each arrival woke
twice or three times a write (each wake-up about 0.5 ms of CPU on those machines, lanes/ticker.py).
A task of its own keeps receiving
meanwhile: nng's Pull socket holds about one message for an owner that is not receiving, and the
orchestrator's non-blocking send of the next one would fail (that event would wait for a re-send).
The orchestrator keeps each event until its acknowledgement comes back, so a crash here loses
nothing and a re-sent event is ignored by its id.
"""

from __future__ import annotations

import logging
import sqlite3
import time

import trio

from lanes.lane import LaneContext, lane_main
from pipeline.audit.store import AuditStore
from pipeline.orchestration.storage import is_full
from pipeline.protocol.messages import (
    AuditAck,
    AuditBatch,
    AuditEvent,
    AuditInbox,
    AuditLaneInbox,
    BadMessage,
    Codec,
)
from pipeline.protocol.transport import Inbox, Outbox

log = logging.getLogger(__name__)


def retain(store: AuditStore, lane: LaneContext) -> float:
    """Apply the configured retention limits now; returns when to apply them next (monotonic)."""
    audit = lane.config.audit
    try:
        deleted = store.prune(max_age_seconds=audit.max_age_days * 86400.0, max_requests=audit.max_requests)
    except (sqlite3.OperationalError, OSError) as exc:
        if not is_full(exc):
            raise
        log.warning("retention: the disk is full (%s); trying again in a minute", exc)
        return time.monotonic() + 60.0
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


Received = AuditLaneInbox | BadMessage
EVENTS: Codec[AuditInbox] = Codec(AuditInbox)


async def receive_all(inbox: Inbox, into: trio.MemorySendChannel[Received]) -> None:
    while True:
        await into.send(await inbox.next())


def gathered(first: Received, received: trio.MemoryReceiveChannel[Received]) -> list[Received]:
    """`first` and everything received after it so far."""
    messages = [first]
    while True:
        try:
            messages.append(received.receive_nowait())
        except trio.WouldBlock:
            return messages


async def serve(lane: LaneContext) -> None:
    config = lane.config
    store = AuditStore(config.audit.path)
    inbox: Inbox = Inbox(config.bind("audit"), AuditLaneInbox, config.tls)
    acks = lane.control  # the orchestrator reads them at its ticks: an acknowledgement is never urgent
    lane.heartbeat()
    prune_at = retain(store, lane)
    # At most what the orchestrator keeps unacknowledged, so never more than it would re-send.
    into, received = trio.open_memory_channel[Received](config.audit.max_pending)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_all, inbox, into)
        while True:
            first = await received.receive()
            messages = gathered(first, received)
            if time.monotonic() >= prune_at:  # events (heartbeat snapshots at least) keep arriving
                prune_at = retain(store, lane)
            await persist(lane, store, acks, messages)


def unbatched(messages: list[Received]) -> list[AuditInbox | BadMessage]:
    """Each event of `messages`, a batch's in its order; a batched event that does not decode is a
    BadMessage of its own (the rest of its batch is kept)."""
    out: list[AuditInbox | BadMessage] = []
    for msg in messages:
        if not isinstance(msg, AuditBatch):
            out.append(msg)
            continue
        for raw in msg.events:
            try:
                out.append(EVENTS.decode(raw))
            except BadMessage as exc:
                out.append(exc)
    return out


async def persist(lane: LaneContext, store: AuditStore, acks: Outbox, messages: list[Received]) -> None:
    """Write the events among `messages` in one transaction, then acknowledge them in one AuditAck."""
    events = []
    for msg in unbatched(messages):
        if isinstance(msg, BadMessage):
            lane.fault("bad_request", str(msg))
        else:
            events.append(msg)
    if not events:
        return
    start_ns = time.time_ns()
    try:
        ids = store.add(events)
    except (sqlite3.OperationalError, OSError) as exc:
        if not is_full(exc):
            raise
        # Not acknowledged, so the orchestrator keeps them and sends them again (audit.resend_after)
        lane.fault("storage_full", f"the audit store cannot write {len(events)} events: {exc}")
        await trio.sleep(lane.config.audit.resend_after)
        return
    trace_persisted(lane, events, start_ns)
    lane.state.runs += len(ids)
    try:
        await acks.put(AuditAck(event_ids=ids), timeout=lane.config.timeouts.send)
    except trio.TooSlowError:
        lane.fault("timeout", "the orchestrator did not take an audit acknowledgement")


def main() -> None:
    lane_main("audit", serve)


if __name__ == "__main__":
    main()
