"""The orchestrator's write-ahead journal: what a restarted orchestrator needs to carry on
every request it was serving, written before any of it reaches a client.

Why a journal of its own and not the audit store: a chunk goes to its client as soon as its
step is decided, while the audit lane makes that step durable later (through the outbox, its
acks and its own restarts, possibly on another host). The audit store can therefore lag what
a client has already seen, and a rebuild from it would repeat or contradict tokens. The
journal is written in the same synchronous call that makes a step's chunk visible, so every
chunk a client saw is in it. It also holds the audit outbox itself, so events the audit lane
had not acknowledged survive the orchestrator too.

SQLite in WAL mode with synchronous=NORMAL: a commit is a write() into the WAL file, which
survives the process being killed (what this is for); a power cut may lose the last commits but
never corrupts the file. The orchestrator writes each burst of decided steps (with their outbox
rows and acknowledgements) in one `transaction`: one commit a burst, not three a step, and what
it acknowledges to the verify lane or shows a client comes after that commit. A request's rows go when its
retention ends, so the file stays the size of what is in flight or retained.

A file can still be damaged under it (a disk error, a stray write, a cut copy). `open_journal`
checks it before the orchestrator uses it; one that SQLite cannot open, whose `quick_check`
fails or that another format wrote is moved aside with a timestamp, and the orchestrator starts
with an empty journal and one warning naming the moved file. What is lost is the previous run's
in-flight requests, which cannot be resumed; the audit store still holds their records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculation import Speculation
from pipeline.orchestration.storage import StorageFull, is_full
from pipeline.protocol.messages import StepRecord

KEPT_FAULTS = 200
FORMAT = 1  # PRAGMA user_version; 0: a journal from before formats were recorded, read as 1
T = TypeVar("T")
log = logging.getLogger(__name__)
# A step row and an outbox row, written one at a time or a transaction's together (`_write_held`)
PUT_STEP = "INSERT OR REPLACE INTO steps VALUES (?, ?, ?)"
PUT_EVENT = "INSERT OR REPLACE INTO outbox VALUES (?, ?)"

SCHEMA = """
CREATE TABLE IF NOT EXISTS opened (request_id TEXT PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    request_id TEXT NOT NULL, step INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (request_id, step)
);
CREATE TABLE IF NOT EXISTS results (request_id TEXT PRIMARY KEY, result BLOB NOT NULL, wall REAL NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (event_id TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS faults (seq INTEGER PRIMARY KEY AUTOINCREMENT, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value BLOB NOT NULL);
"""


class OpenedRecord(msgspec.Struct, kw_only=True, frozen=True):
    """An admitted request, as the hub made it."""

    request_id: str
    secret: str  # what poll, resume and cancel must present
    owner: str = ""  # "gateway:<pid>" for the gateway's requests: freed when that process dies
    idempotency_key: str = ""  # a repeated Submit with this key gets this request back
    submitted: float  # wall clock
    prompt_tokens: list[int]
    params: SamplingParams
    speculation: Speculation
    seed: int
    trace: dict[str, str] = {}


@dataclass
class JournaledRequest:
    opened: OpenedRecord
    steps: list[StepRecord] = field(default_factory=list)
    result: Result | None = None
    finished_wall: float | None = None


@dataclass
class Recovered:
    requests: list[JournaledRequest]
    outbox: list[tuple[str, bytes]]
    faults: list[bytes]
    state: dict[str, bytes]


class Journal:
    """Writes that must precede what a client sees (`opened`, `stepped`, `probe`) raise StorageFull
    when the disk is full; the others (a result, the outbox, faults, counters) are kept in memory
    by their owners meanwhile, so their failure is only remembered (`take_failure`, storage.py)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.db.execute(f"PRAGMA user_version = {FORMAT}")
        self.encoder = msgspec.msgpack.Encoder()
        self.failure = ""  # the last write that failed for want of space, until taken
        self.batching = False  # inside `transaction`: writes wait for its one commit
        # Inside `transaction`, its step and outbox rows, written together just before its commit
        self.held_steps: list[tuple[str, int, bytes]] = []
        self.held_outbox: list[tuple[str, bytes]] = []

    @contextlib.contextmanager
    def _storage(self, critical: bool) -> Iterator[None]:
        try:
            yield
        except (sqlite3.OperationalError, OSError) as exc:
            if not is_full(exc):
                raise
            self.failure = str(exc) or type(exc).__name__
            if critical:
                raise StorageFull(self.failure) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """The writes inside, committed together at its end (a nested one joins the outer). A commit
        the disk cannot take rolls them all back and raises StorageFull: none of them happened. So
        does a transaction SQLite already rolled back itself (it may, on SQLITE_FULL)."""
        if self.batching:
            yield
            return
        self.batching = True
        try:
            self.db.execute("BEGIN")
            yield
            self._write_held()
            if not self.db.in_transaction:
                raise StorageFull(self.failure or "the journal's transaction was rolled back")
            with self._storage(critical=True):
                self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        finally:
            self.batching = False
            self.held_steps, self.held_outbox = [], []

    def _write_held(self) -> None:
        """The transaction's step and outbox rows, in one statement each: a statement a row was a
        sizable share of the orchestrator's work a step (docs/benchmarks.md, "What the per-step record
        keeping costs")."""
        if self.held_steps:
            with self._storage(critical=True):
                self.db.executemany(PUT_STEP, self.held_steps)
        if self.held_outbox:
            with self._storage(critical=False):
                self.db.executemany(PUT_EVENT, self.held_outbox)

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """Several statements as one: a transaction of their own, or the one they are inside."""
        if self.batching:
            yield
        else:
            with self.db:
                self.db.execute("BEGIN")
                yield

    def take_failure(self) -> str:
        failure, self.failure = self.failure, ""
        return failure

    def probe(self) -> None:
        """A small write: raises StorageFull while the disk cannot take it."""
        with self._storage(critical=True):
            self.db.execute("INSERT OR REPLACE INTO state VALUES ('probe', x'00')")

    def close(self) -> None:
        self.db.close()

    # --- requests ----------------------------------------------------------------------

    def opened(self, record: OpenedRecord) -> None:
        with self._storage(critical=True):
            self.db.execute(
                "INSERT OR REPLACE INTO opened VALUES (?, ?)",
                (record.request_id, self.encoder.encode(record)),
            )

    def stepped(self, request_id: str, record: StepRecord) -> None:
        """Inside a transaction the row waits for its commit, and a full disk fails that commit."""
        row = (request_id, record.step, self.encoder.encode(record))
        if self.batching:
            self.held_steps.append(row)
            return
        with self._storage(critical=True):
            self.db.execute(PUT_STEP, row)

    def finished(self, request_id: str, result: Result, wall: float) -> None:
        with self._storage(critical=False):
            self.db.execute(
                "INSERT OR REPLACE INTO results VALUES (?, ?, ?)",
                (request_id, self.encoder.encode(result), wall),
            )

    def forget(self, request_id: str) -> None:
        with self._storage(critical=False), self._atomic():
            for table in ("opened", "steps", "results"):
                self.db.execute(f"DELETE FROM {table} WHERE request_id = ?", (request_id,))

    # --- the audit outbox, faults and counters -----------------------------------------

    def outbox_add(self, event_id: str, data: bytes) -> None:
        if self.batching:  # with the transaction's commit (`stepped`)
            self.held_outbox.append((event_id, data))
            return
        with self._storage(critical=False):
            self.db.execute(PUT_EVENT, (event_id, data))

    def outbox_restore(self, events: list[tuple[str, bytes]]) -> None:
        """Every event in `events` back in the outbox (after a rolled-back transaction), in one commit."""
        with self._storage(critical=False), self._atomic():
            self.db.executemany(PUT_EVENT, events)

    def outbox_ack(self, event_ids: list[str]) -> None:
        """In one commit: outside a transaction SQLite commits each statement of an executemany by
        itself, a write into the WAL and six locks for every event."""
        with self._storage(critical=False), self._atomic():
            self.db.executemany("DELETE FROM outbox WHERE event_id = ?", [(e,) for e in event_ids])

    def fault(self, data: bytes) -> None:
        with self._storage(critical=False), self._atomic():
            self.db.execute("INSERT INTO faults (data) VALUES (?)", (data,))
            self.db.execute(
                "DELETE FROM faults WHERE seq <= (SELECT MAX(seq) FROM faults) - ?", (KEPT_FAULTS,)
            )

    def put_state(self, key: str, value: bytes) -> None:
        with self._storage(critical=False):
            self.db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (key, value))

    # --- recovery ----------------------------------------------------------------------

    def recover(self) -> Recovered:
        """Everything journaled, oldest request first. A request with a row that cannot be read
        (written by another version, damaged) is dropped with a warning rather than stopping the
        orchestrator at every start: its client then gets unknown_request."""
        requests: dict[str, JournaledRequest] = {}
        unreadable: set[str] = set()
        for request_id, blob in self.db.execute("SELECT request_id, record FROM opened ORDER BY rowid"):
            if (opened := readable(blob, OpenedRecord)) is None:
                unreadable.add(request_id)
            else:
                requests[request_id] = JournaledRequest(opened)
        steps = self.db.execute("SELECT request_id, record FROM steps ORDER BY request_id, step")
        for request_id, blob in steps:
            if (journaled := requests.get(request_id)) is not None:
                if (step := readable(blob, StepRecord)) is None:
                    unreadable.add(request_id)
                else:
                    journaled.steps.append(step)
        for request_id, blob, wall in self.db.execute("SELECT request_id, result, wall FROM results"):
            if (journaled := requests.get(request_id)) is not None:
                if (result := readable(blob, Result)) is None:
                    unreadable.add(request_id)
                journaled.result, journaled.finished_wall = result, wall
        for request_id in unreadable:
            log.warning("journal: request %s has a row this version cannot read; dropped", request_id)
            requests.pop(request_id, None)
            self.forget(request_id)
        return Recovered(
            requests=list(requests.values()),
            outbox=[(e, bytes(d)) for e, d in self.db.execute("SELECT event_id, data FROM outbox")],
            faults=[bytes(d) for (d,) in self.db.execute("SELECT data FROM faults ORDER BY seq")],
            state={k: bytes(v) for k, v in self.db.execute("SELECT key, value FROM state")},
        )


def journal_problem(path: Path) -> str | None:
    """What makes the journal at `path` unusable, or None (a missing file is fine: it is new)."""
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(str(path))  # read-write: a WAL left by a killed orchestrator is read too
        try:
            checked = [row[0] for row in db.execute("PRAGMA quick_check")]
            version = db.execute("PRAGMA user_version").fetchone()[0]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    if checked != ["ok"]:
        return f"quick_check: {'; '.join(map(str, checked[:3]))}"
    if version not in (0, FORMAT):
        return f"written in journal format {version}, this version reads {FORMAT}"
    return None


def open_journal(path: str | Path) -> Journal:
    """The journal at `path`, checked first; a damaged one is moved aside (see the module)."""
    if str(path) == ":memory:":
        return Journal(path)
    path = Path(path)
    problem = journal_problem(path)
    if problem is not None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = path.with_name(f"{path.name}.damaged-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{path}{suffix}", f"{aside}{suffix}")
        log.warning(
            "journal %s is damaged (%s): moved to %s; starting with an empty journal. The previous "
            "run's in-flight requests cannot be resumed (the audit store keeps their records).",
            path, problem, aside,
        )  # fmt: skip
    return Journal(path)


def readable(blob: bytes, kind: type[T]) -> T | None:
    try:
        return msgspec.msgpack.decode(blob, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
