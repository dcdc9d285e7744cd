"""Audit events not yet acknowledged by the audit lane.

Every event stays here, encoded, until an AuditAck names it; one not acknowledged within
`resend_after` is due again, and all of them are due at once when the audit lane comes back.
The audit lane ignores a repeat by its event id, so re-sending is always safe.
"""

from __future__ import annotations

import math


class AuditOutbox:
    def __init__(self) -> None:
        self.pending: dict[str, tuple[bytes, float]] = {}  # event id -> (bytes, when last sent)

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, event_id: str, data: bytes, sent_at: float | None) -> None:
        self.pending[event_id] = (data, -math.inf if sent_at is None else sent_at)

    def unsent(self, event_id: str) -> None:
        if event_id in self.pending:
            self.pending[event_id] = (self.pending[event_id][0], -math.inf)

    def ack(self, event_ids: list[str]) -> None:
        for event_id in event_ids:
            self.pending.pop(event_id, None)

    def all_unsent(self) -> None:
        """The audit lane restarted: whatever it had not acknowledged may be lost."""
        self.pending = {key: (data, -math.inf) for key, (data, _) in self.pending.items()}

    def due(self, now: float, resend_after: float) -> list[tuple[str, bytes]]:
        """Events to send again now; each is marked sent at `now`."""
        out = [(key, data) for key, (data, sent) in self.pending.items() if sent < now - resend_after]
        for key, data in out:
            self.pending[key] = (data, now)
        return out
