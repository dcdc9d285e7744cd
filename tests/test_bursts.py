"""The orchestrator takes decided steps in bursts (`Hub.on_burst`): one journal transaction a burst,
StepsJournaled and the audit events only after its commit, and the audit events of a burst as one
AuditBatch that the audit lane writes in one transaction and acknowledges once. Whole requests run
through the in-process World (tests/orchestration_harness.py) with every forward's steps held for
one burst, as the verify lane's 20 ms reports hold them."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

import msgspec
import pytest

from lanes.audit import unbatched
from pipeline.audit.store import AuditStore
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Model
from pipeline.model.prompts import prompt_tokens
from pipeline.orchestration.effects import BATCH_EVENTS, Send, batched
from pipeline.orchestration.hub import unreported
from pipeline.orchestration.journal import PUT_STEP, Journal
from pipeline.orchestration.storage import StorageFull
from pipeline.protocol.messages import (
    AuditBatch,
    AuditLaneInbox,
    BadMessage,
    Codec,
    Decided,
    StepEvent,
    StepRecord,
    StepsJournaled,
    encode,
)
from pipeline.protocol.transport import MAX_MESSAGE_BYTES

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = ("ab ab ab ab cd cd", "cd ab cd ab")


class Killed(BaseException):
    """The orchestrator dies here (not an error its core would catch and carry on from)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("bursts") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


def plain(model: Model, prompt: str) -> list[int]:
    assert model.tokenizer is not None
    tokens = prompt_tokens(model.tokenizer, prompt, chat=False, messages=None)
    return decode(model, tokens, PARAMS, NoDraftSource(), k=0).tokens


def bursting(model: Model, path: Path) -> World:
    world = World(model, journal_path=str(path), burst_replies=True)
    world.up()
    return world


def journaled(path: Path) -> dict[str, int]:
    """The last step of each request that another connection reads in the journal: what is committed."""
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT request_id, MAX(step) FROM steps GROUP BY request_id"))


def test_bursts_give_the_plain_tokens_and_acknowledge_only_committed_steps(model, tmp_path):
    world = bursting(model, tmp_path / "journal.sqlite")
    ids = [world.submit(prompt, params=PARAMS, drafter="none") for prompt in PROMPTS]
    on_burst, sizes, told = world.hub.on_burst, [], []

    def checked(msgs, now):
        sends = on_burst(msgs, now)
        sizes.append(sum(isinstance(m, Decided) for m in unreported(msgs)))
        committed = journaled(tmp_path / "journal.sqlite")
        for send in sends:
            if isinstance(send.message, StepsJournaled):
                told.append(send.message.steps)
                assert all(committed[r] >= step for r, step in send.message.steps.items())
        return sends

    world.hub.on_burst = checked  # type: ignore[method-assign]
    world.run()
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        result = world.result(request_id)
        assert result is not None and result.tokens == plain(model, prompt)
    assert max(sizes) > world.config.run.run_ahead  # bursts of several steps of both requests
    assert told and len(told) < sum(sizes)  # one StepsJournaled a burst, not one a step
    batches = [s for s in world.sent if s.lane == "audit" and len(s.event_ids) > 1]
    assert batches and all(len(s.event_ids) <= BATCH_EVENTS for s in batches)
    steps = sorted((e.request_id, e.step) for e in world.audited.values() if isinstance(e, StepEvent))
    assert len(steps) == len(set(steps)) == sum(world.result(r).stats.steps + 1 for r in ids)
    assert len(world.hub.ledger.outbox) == 0  # every batched event acknowledged


def test_a_kill_inside_a_burst_loses_only_unacknowledged_steps_and_the_output_is_undisturbed(model, tmp_path):
    path = tmp_path / "journal.sqlite"
    world = bursting(model, path)
    request_id = world.submit(PROMPTS[0], params=PARAMS, drafter="none")
    on_data, seen = world.hub.on_data, []

    def dies_at_the_twelfth(msg, now):
        if isinstance(msg, Decided):
            seen.append(msg.step)
            if len(seen) == 12:  # steps before it in this burst were written, not committed
                raise Killed
        return on_data(msg, now)

    world.hub.on_data = dies_at_the_twelfth  # type: ignore[method-assign]
    with pytest.raises(Killed):
        world.run()
    before = journaled(path).get(request_id, -1)
    assert before < seen[-1] - 1  # the burst's earlier steps are not in the journal
    told = [s.message.steps[request_id] for s in world.sent if isinstance(s.message, StepsJournaled)]
    assert max(told) <= before  # the verify lane never heard of a step the journal lacks
    world.orchestrator_killed(deliver_in_flight=False)
    assert world.hub.front.machine(request_id).step == before  # recovered from the commits only
    world.run()
    result = world.result(request_id)
    assert result is not None and result.tokens == plain(model, PROMPTS[0])


def test_a_burst_the_disk_cannot_commit_ends_its_requests_with_storage_full(model, tmp_path):
    world = bursting(model, tmp_path / "journal.sqlite")
    request_id = world.submit(PROMPTS[0], params=PARAMS, drafter="none")
    world.run(until=3)
    full = FullOnCommit(world.hub.journal.db)
    world.hub.journal.db = full  # type: ignore[assignment]
    before = journaled(tmp_path / "journal.sqlite").get(request_id, -1)
    sends: list[Send] = []
    on_burst = world.hub.on_burst
    world.hub.on_burst = lambda msgs, now: sends.extend(out := on_burst(msgs, now)) or out  # type: ignore
    world.run()
    result = world.result(request_id)
    assert result is not None and result.finish_reason == "storage_full"
    assert journaled(tmp_path / "journal.sqlite").get(request_id, -1) == before  # nothing half-written
    assert not any(isinstance(s.message, StepsJournaled) for s in sends)  # nothing acknowledged
    assert world.hub.journal.take_failure()  # the storage guard hears of it
    assert request_id not in world.verifier.requests  # its lanes' state is freed


class FullOnCommit:
    """A journal connection whose commits fail as on a full disk."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)

    def __enter__(self) -> sqlite3.Connection:  # `with db:` (Journal._atomic) commits by the connection
        return self.db.__enter__()

    def __exit__(self, *exc: object) -> bool | None:
        return self.db.__exit__(*exc)  # type: ignore[arg-type]


def test_a_journal_transaction_commits_once_nests_and_rolls_back_whole(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    with journal.transaction():
        journal.outbox_add("a", b"1")
        with journal.transaction():  # joins the outer one
            journal.fault(b"f")
        assert journal.db.in_transaction
    assert not journal.db.in_transaction
    with pytest.raises(RuntimeError), journal.transaction():
        journal.outbox_add("b", b"2")
        raise RuntimeError
    journal.db = FullOnCommit(journal.db)  # type: ignore[assignment]
    with pytest.raises(StorageFull), journal.transaction():
        journal.outbox_add("c", b"3")
    journal.db = journal.db.db  # type: ignore[attr-defined]
    assert [e for e, _ in journal.recover().outbox] == ["a"]
    assert len(journal.recover().faults) == 1


def test_a_transaction_writes_its_step_and_outbox_rows_in_order_at_its_commit(tmp_path):
    """Held until the commit and written in one statement each: a later row for the same key still
    replaces an earlier one, nothing is written before, and a rolled-back transaction writes none."""
    journal = Journal(tmp_path / "j.sqlite")
    with sqlite3.connect(tmp_path / "j.sqlite") as other:
        with journal.transaction():
            for step, token in ((0, 5), (1, 6), (1, 7)):
                journal.stepped("r", StepRecord(step, 0, [token], 0, 0.0, 0.0, step))
            journal.outbox_add("e", b"1")
            journal.outbox_add("e", b"2")
            assert other.execute("SELECT COUNT(*) FROM steps").fetchone() == (0,)
        rows = other.execute("SELECT record FROM steps WHERE request_id = 'r' ORDER BY step").fetchall()
        assert [msgspec.msgpack.decode(blob, type=StepRecord).tokens for (blob,) in rows] == [[5], [7]]
        assert journal.recover().outbox == [("e", b"2")]
        with pytest.raises(RuntimeError), journal.transaction():
            journal.stepped("r", StepRecord(2, 0, [8], 0, 0.0, 0.0, 2))
            raise RuntimeError
        assert (journal.held_steps, journal.held_outbox) == ([], [])
        assert other.execute("SELECT MAX(step) FROM steps").fetchone() == (1,)
    journal.stepped("r", StepRecord(2, 0, [8], 0, 0.0, 0.0, 2))  # outside a transaction: at once
    with sqlite3.connect(tmp_path / "j.sqlite") as other:
        assert other.execute("SELECT MAX(step) FROM steps").fetchone() == (2,) and journal.held_steps == []


def test_acknowledged_events_leave_the_outbox_in_one_commit(tmp_path):
    """Outside a transaction SQLite commits each statement of an executemany by itself: a write into
    the WAL and its locks for every event the audit lane acknowledged."""
    journal = Journal(tmp_path / "j.sqlite")
    for event in "abcd":
        journal.outbox_add(event, b"1")
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    journal.outbox_ack(["a", "b", "c"])
    journal.db.set_trace_callback(None)
    assert [s.split()[0] for s in statements] == ["BEGIN", "DELETE", "DELETE", "DELETE", "COMMIT"]
    assert [e for e, _ in journal.recover().outbox] == ["d"]


def step_event(request_id: str, step: int) -> StepEvent:
    return StepEvent(
        event_id=f"{request_id}:{step}", request_id=request_id, time=float(step), step=step, drafter="none",
        k=0, drafted=[], emitted=[step], decisions=[], final_u=None, draws=step, batch_size=1,
    )  # fmt: skip


def test_batched_gathers_lone_audit_events_in_order_and_bounds_each_message():
    events = [step_event("r", i) for i in range(BATCH_EVENTS + 3)]
    other = Send("verify", StepsJournaled(steps={"r": 1}))
    sends = [other, *(Send("audit", encode(e), (e.event_id,)) for e in events)]
    out = batched(sends)
    assert out[0] == other and [len(s.event_ids) for s in out[1:]] == [BATCH_EVENTS, 3]
    assert batched(out) == out  # a batch is never batched again
    assert batched(sends[:2]) == sends[:2]  # a lone event goes as it is
    codec: Codec = Codec(AuditLaneInbox)
    decoded = [codec.decode(s.message) for s in out[1:]]
    assert all(isinstance(m, AuditBatch) for m in decoded)
    assert unbatched(decoded) == events
    assert [i for s in out[1:] for i in s.event_ids] == [e.event_id for e in events]


def test_a_bad_event_in_a_batch_costs_only_itself_and_the_rest_are_stored_at_once(tmp_path):
    """Well-formed msgpack that is no audit event (bytes that are not msgpack spoil the whole message)."""
    good = [step_event("r", 0), step_event("r", 1)]
    stranger = encode(StepsJournaled(steps={}))
    raw = [msgspec.Raw(encode(good[0])), msgspec.Raw(stranger), msgspec.Raw(encode(good[1]))]
    batch = Codec(AuditLaneInbox).decode(encode(AuditBatch(events=raw)))
    events = unbatched([batch])
    assert isinstance(events[1], BadMessage) and [events[0], events[2]] == good
    store = AuditStore(tmp_path / "audit.sqlite")
    assert store.add([events[0], events[2]]) == ["r:0", "r:1"]
    assert store.events("r") == good


def test_the_verify_lane_hears_of_the_journal_every_half_run_ahead_and_never_waits_for_it(model, tmp_path):
    """One step a burst (a slow machine's case): StepsJournaled goes once the journal is half the
    run-ahead past what the lane heard, not after every step, and the request still runs to its end
    with no tick (no driver held at the run-ahead for want of news)."""
    world = World(model)
    world.up()
    request_id = world.submit(PROMPTS[0], params=PARAMS, drafter="none")
    world.run()
    result = world.result(request_id)
    assert result is not None and result.tokens == plain(model, PROMPTS[0])
    told = [s.message.steps[request_id] for s in world.sent if isinstance(s.message, StepsJournaled)]
    half = world.config.run.run_ahead // 2
    assert told[0] == 0 and all(b - a >= half for a, b in itertools.pairwise(told))
    assert len(told) <= result.stats.steps // half + 1


def test_batched_keeps_each_message_under_what_the_audit_lane_can_receive():
    """Long prompts make large events (RequestOpened holds the prompt, the summary the output): a re-send
    of 256 of them must not be one message over the audit lane's receive limit, which nng drops (closing
    the connection) so that the same batch failed again at every re-send."""
    big = "x" * (MAX_MESSAGE_BYTES // 200)  # 200 such events exceed the limit, under BATCH_EVENTS of them
    events = [msgspec.structs.replace(step_event("r", i), trace={"pad": big}) for i in range(BATCH_EVENTS)]
    out = batched([Send("audit", encode(e), (e.event_id,)) for e in events])
    assert len(out) > 1 and all(len(s.message) <= MAX_MESSAGE_BYTES // 2 for s in out)
    assert [i for s in out for i in s.event_ids] == [e.event_id for e in events]
    assert unbatched([Codec(AuditLaneInbox).decode(s.message) for s in out]) == events


def test_a_request_finished_in_a_burst_the_disk_cannot_commit_stays_finished_after_a_restart(model, tmp_path):
    """Its client saw it done with all its tokens: the result and the unacknowledged audit events of the
    burst are journaled again after the rollback (when the disk takes them), so a restarted orchestrator
    neither decodes it again nor loses its summary."""
    path = tmp_path / "journal.sqlite"
    world = bursting(model, path)
    world.lost.add("audit")  # no acknowledgement comes: every event must stay in the journal's outbox
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    request_id = world.submit(PROMPTS[0], params=short, drafter="none")
    db = world.hub.journal.db
    world.hub.journal.db = FullOnCommit(db)  # type: ignore[assignment]
    world.run()
    served = world.result(request_id)
    assert served is not None and served.error is None  # done, every token shown
    assert journaled(path).get(request_id) is None  # the burst's steps were rolled back
    world.hub.journal.db = db  # the disk takes writes again
    pending = set(world.hub.ledger.outbox.pending)
    with sqlite3.connect(path) as other:
        assert {e for (e,) in other.execute("SELECT event_id FROM outbox")} >= pending
        assert [r for (r,) in other.execute("SELECT request_id FROM results")] == [request_id]
    world.lost.clear()
    world.orchestrator_killed(deliver_in_flight=False)
    opens = len(world.to_verifier)
    world.run()
    world.tick(5.0)
    world.run()
    assert world.result(request_id) == served  # not decoded again: its lanes are only freed (again)
    assert [type(m).__name__ for m in world.to_verifier[opens:]] == ["Close"]
    assert f"{request_id}:summary" in world.audited


class RefusedOnce(FullOnCommit):
    """A journal connection whose first commit of steps fails for a reason other than space (a
    read-only file); the ones after it succeed."""

    refused = stepped = False

    def executemany(self, sql: str, *args: object) -> sqlite3.Cursor:
        self.stepped = self.stepped or sql == PUT_STEP  # a burst's steps
        return self.db.executemany(sql, *args)

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "COMMIT" and self.stepped and not self.refused:
            self.refused = True
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return self.db.execute(sql, *args)


def test_a_burst_the_journal_refuses_for_another_reason_is_lost_whole_and_leaves_no_gap(model, tmp_path):
    """Its steps were shown by the request's machine but are in no journal: its request ends as one the
    journal refused, rather than the next bursts journaling (and acknowledging) the steps after a gap,
    which a restarted orchestrator would replay as if they followed the steps before it."""
    path = tmp_path / "journal.sqlite"
    world = bursting(model, path)
    request_id = world.submit(PROMPTS[0], params=PARAMS, drafter="none")
    world.hub.journal.db = RefusedOnce(world.hub.journal.db)  # type: ignore[assignment]
    on_burst, told = world.hub.on_burst, []

    def checked(msgs, now):
        sends = on_burst(msgs, now)
        told.extend(s.message.steps for s in sends if isinstance(s.message, StepsJournaled))
        return sends

    world.hub.on_burst = checked  # type: ignore[method-assign]
    world.run()
    result = world.result(request_id)
    assert result is not None and result.finish_reason == "storage_full"
    committed = journaled(path)
    assert all(committed.get(r, -1) >= step for steps in told for r, step in steps.items())
    with sqlite3.connect(path) as db:
        steps = [s for (s,) in db.execute("SELECT step FROM steps WHERE request_id = ?", (request_id,))]
    assert steps == list(range(len(steps)))  # no gap
