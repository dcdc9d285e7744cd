"""The audit store: an append-only SQLite table of immutable events, keyed by event id.

WAL mode with full sync, so an event acknowledged to the orchestrator survives a crash of
the audit lane; `INSERT OR IGNORE` makes a re-sent event harmless. Readers (`speclanes
audit ...`) open the same file while the lane writes it: WAL lets them read a consistent
snapshot without blocking the writer. Retention deletes whole requests, never single
events, so what remains of a request is always complete enough to verify.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from pipeline.observability.request_ids import request_key, resolve
from pipeline.protocol.messages import AuditEvent, AuditInbox, StepEvent, encode

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


def decode_event(body: bytes) -> AuditEvent:
    return _decoder.decode(body)


class AuditStore:
    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        """`readonly` opens an existing store for queries (it never creates one, never writes)."""
        if readonly:
            if not Path(path).is_file():
                raise FileNotFoundError(f"no audit database at {path}")
            self.db = sqlite3.connect(path, isolation_level=None)
            self.db.execute("PRAGMA busy_timeout=5000")
            self.db.execute("PRAGMA query_only=ON")
            return
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
        return [decode_event(body) for (body,) in rows]

    def request_ids(self) -> list[str]:
        return [
            r
            for (r,) in self.db.execute(
                "SELECT DISTINCT request_id FROM events WHERE request_id != '' ORDER BY rowid"
            )
        ]

    def resolve(self, name: str) -> str:
        """The one request `name` names: its id, the HTTP response's id (`chatcmpl-...`), or a
        unique prefix of either. LookupError if none; AmbiguousId, listing them, if several."""
        key = request_key(name)
        rows = self.db.execute(
            "SELECT DISTINCT request_id FROM events WHERE request_id != '' AND substr(request_id, 1, ?) = ?",
            (len(key), key),
        ).fetchall()
        return resolve(name, [r for (r,) in rows], "request", " in the audit store")

    def of_types(self, types: Iterable[str], request_id: str | None = None) -> list[AuditEvent]:
        """Events of the given types (oldest first), of one request or of all."""
        names = list(types)
        marks = ",".join("?" * len(names))
        sql = f"SELECT body FROM events WHERE type IN ({marks})"
        args: list[object] = names
        if request_id is not None:
            sql += " AND request_id = ?"
            args = [*names, request_id]
        return [decode_event(body) for (body,) in self.db.execute(sql + " ORDER BY time", args)]

    def step_counts(self) -> dict[str, int]:
        """Recorded steps per request (the prefill is step 0)."""
        return dict(
            self.db.execute(
                "SELECT request_id, COUNT(*) FROM events WHERE type = 'StepEvent' GROUP BY request_id"
            )
        )

    def counts(self) -> dict[str, int]:
        """Events by type, plus the number of requests."""
        counts = dict(self.db.execute("SELECT type, COUNT(*) FROM events GROUP BY type").fetchall())
        (requests,) = self.db.execute(
            "SELECT COUNT(DISTINCT request_id) FROM events WHERE request_id != ''"
        ).fetchone()
        return {"requests": requests, **counts}

    def prune(self, *, max_age_seconds: float, max_requests: int, now: float | None = None) -> int:
        """Apply the retention limits (0 disables a limit); returns how many requests were deleted.

        A request goes whole once its *last* event is older than the age limit, or once it is
        not among the newest `max_requests` (by last event), so a running request is never cut.
        Lane-level events (request id "") go by their own age.
        """
        now = time.time() if now is None else now
        doomed: set[str] = set()
        if max_age_seconds > 0:
            cutoff = now - max_age_seconds
            doomed.update(
                r
                for (r,) in self.db.execute(
                    "SELECT request_id FROM events WHERE request_id != '' GROUP BY request_id "
                    "HAVING MAX(time) < ?",
                    (cutoff,),
                )
            )
        if max_requests > 0:
            doomed.update(
                r
                for (r,) in self.db.execute(
                    "SELECT request_id FROM events WHERE request_id != '' GROUP BY request_id "
                    "ORDER BY MAX(time) DESC LIMIT -1 OFFSET ?",
                    (max_requests,),
                )
            )
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("DELETE FROM events WHERE request_id = ?", [(r,) for r in doomed])
            if max_age_seconds > 0:
                self.db.execute(
                    "DELETE FROM events WHERE request_id = '' AND time < ?", (now - max_age_seconds,)
                )
        return len(doomed)

    def close(self) -> None:
        self.db.close()
