"""The audit store: an append-only SQLite table of immutable events, keyed by event id.

WAL mode with full sync, so an event acknowledged to the orchestrator survives a crash of
the audit lane; `INSERT OR IGNORE` makes a re-sent event harmless.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

import msgspec

from .messages import AuditEvent, AuditInbox, StepEvent, encode

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    event_id   TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    step       INTEGER,
    type       TEXT NOT NULL,
    time       REAL NOT NULL,
    body       BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_request ON events (request_id, step);
"""

_decoder = msgspec.msgpack.Decoder(AuditInbox)


class AuditStore:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def add(self, events: Iterable[AuditEvent]) -> list[str]:
        """Persist events in one transaction; returns their ids once durable."""
        rows = [
            (
                e.event_id,
                e.request_id,
                e.step if isinstance(e, StepEvent) else None,
                type(e).__name__,
                e.time,
                encode(e),
            )
            for e in events
        ]
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?)", rows)
        return [row[0] for row in rows]

    def events(self, request_id: str) -> list[AuditEvent]:
        rows = self.db.execute(
            "SELECT body FROM events WHERE request_id = ? ORDER BY time, step", (request_id,)
        ).fetchall()
        return [_decoder.decode(body) for (body,) in rows]

    def request_ids(self) -> list[str]:
        return [r for (r,) in self.db.execute("SELECT DISTINCT request_id FROM events ORDER BY rowid")]

    def close(self) -> None:
        self.db.close()
