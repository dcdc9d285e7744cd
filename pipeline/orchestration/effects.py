"""What the orchestration core asks of the world: the only outputs of its I/O-free parts.

The request machine returns these; the hub turns `Record`, `Raise`, `Stepped`, `Journaled`
and `FirstToken` into audit events, faults, journal rows and metrics, and hands every `Send`
to the lane process (lanes/orchestrator.py), which owns the sockets. `batched` makes one message of
the audit events sent together (a burst of decided steps, a re-send), bounded in count and bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from pipeline.protocol.messages import AuditBatch, AuditEvent, FaultKind, StepRecord, encode

# Events in one AuditBatch at most: a re-send after an audit restart (up to `audit.max_pending`)
# goes as several messages of bounded size rather than one.
BATCH_EVENTS = 256
# Bytes of events in one AuditBatch at most, a quarter of what the audit lane's socket receives
# (transport.MAX_MESSAGE_BYTES, 64 MiB): nng drops a larger message, and the same batch made again at
# every re-send would never arrive. An event that is larger alone still goes (alone).
BATCH_BYTES = 16 << 20


class Send(NamedTuple):
    lane: str  # verify | draft | audit
    message: msgspec.Struct | bytes  # bytes: audit events already encoded (the outbox keeps them)
    event_ids: tuple[str, ...] = ()  # for audit sends: the outbox entries to mark unsent if it is not taken


def batched(sends: list[Send]) -> list[Send]:
    """`sends` with their lone audit events gathered into AuditBatch messages of at most BATCH_EVENTS
    events and BATCH_BYTES bytes (batches already made stay as they are; a single event goes as it is).
    Why: one message, one wake-up and one transaction in the audit lane per burst of decided steps,
    where one a step cost both processes CPU the forward needed."""
    audit = [send for send in sends if send.lane == "audit" and len(send.event_ids) == 1]
    if len(audit) < 2:
        return sends
    out = [send for send in sends if send.lane != "audit" or len(send.event_ids) != 1]
    for part in bounded(audit):
        if len(part) == 1:
            out.append(part[0])
            continue
        events = [msgspec.Raw(send.message) for send in part]  # type: ignore[arg-type]
        ids = tuple(event_id for send in part for event_id in send.event_ids)
        out.append(Send("audit", encode(AuditBatch(events=events)), ids))
    return out


def bounded(audit: list[Send]) -> list[list[Send]]:
    """`audit` in order, in parts of at most BATCH_EVENTS events and BATCH_BYTES bytes (or one event)."""
    parts: list[list[Send]] = []
    size = 0
    for send in audit:
        length = len(send.message)  # type: ignore[arg-type]
        if not parts or len(parts[-1]) >= BATCH_EVENTS or size + length > BATCH_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(send)
        size += length
    return parts


class Record(NamedTuple):
    event: AuditEvent


class Raise(NamedTuple):
    kind: FaultKind
    lane: str
    message: str
    request_id: str | None = None


class Stepped(NamedTuple):
    drafter: str
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float


class Journaled(NamedTuple):
    """A decided step, for the write-ahead journal: the hub writes it before any poll can read
    the chunk it released (it runs in the same synchronous call)."""

    record: StepRecord


class FirstToken(NamedTuple):
    seconds: float


Effect = Send | Record | Raise | Stepped | Journaled | FirstToken
