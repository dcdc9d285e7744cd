"""What the orchestration core asks of the world: the only outputs of its I/O-free parts.

The request machine returns these; the hub turns `Record`, `Raise`, `Stepped`, `Journaled`
and `FirstToken` into audit events, faults, journal rows and metrics, and hands every `Send`
to the lane process (lanes/orchestrator.py), which owns the sockets.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from pipeline.protocol.messages import AuditEvent, FaultKind, StepRecord


class Send(NamedTuple):
    lane: str  # verify | draft | audit
    message: msgspec.Struct | bytes  # bytes: an audit event already encoded (the outbox keeps them)
    event_id: str = ""  # for audit sends: which outbox entry to mark unsent if the lane cannot take it


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
