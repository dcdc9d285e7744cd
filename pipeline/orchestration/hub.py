"""The orchestrator's core: admits requests, routes every reply and control message to its
collaborators, and returns the messages to send. It does no I/O and reads no clock: the
lane process (lanes/orchestrator.py) passes `now` in and sends what comes back, so fast
tests drive whole requests (steps, faults, lane restarts, resume, cancel) with no sockets.

Collaborators, each passed in or built here with what it needs:
- `ClientFront`: the requests clients poll, resume and cancel;
- `RequestMachine`: one request's step protocol;
- `LaneTable`: each lane's state as the control lane reports it;
- `Ledger`: audit events until the audit lane acknowledges them, faults, totals, snapshots;
- `RequestTracing`: traces and metrics;
- `AdmissionQueue`: which requests decode now and which wait their turn;
- `Journal`: the write-ahead record a restarted orchestrator recovers from (`recover`).

A Submit is admitted in two steps: `admit` (the chat template and the tokenizer: pure, and slow
for a long prompt, so the lane runs it off its event loop) and `open` (the request begins, or
waits its turn). `submit` does both, for callers with no event loop to keep responsive.
"""

from __future__ import annotations

import logging
import secrets
import sqlite3
import time
import uuid

import msgspec

from pipeline.decoding.drafters.kinds import reads_features
from pipeline.decoding.result import Result
from pipeline.decoding.session import Session
from pipeline.model.tokenizer import Tokenizer
from pipeline.orchestration.admission import Admitted, admit
from pipeline.orchestration.admission_queue import AdmissionQueue
from pipeline.orchestration.closing import Closing
from pipeline.orchestration.effects import (
    Effect,
    FirstToken,
    Journaled,
    Raise,
    Record,
    Send,
    Stepped,
)
from pipeline.orchestration.front import ClientFront, unknown
from pipeline.orchestration.journal import Journal, OpenedRecord
from pipeline.orchestration.lane_table import LaneTable
from pipeline.orchestration.ledger import Ledger
from pipeline.orchestration.request import Identity, RequestMachine
from pipeline.orchestration.storage import StorageFull
from pipeline.orchestration.tracing import RequestTracing
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    AuditAck,
    AuditEvent,
    BadMessage,
    Chunks,
    ControlInbox,
    DataInbox,
    ErrorReply,
    Fault,
    FaultKind,
    LaneDown,
    LaneFailed,
    Reported,
    RequestOpened,
    Shutdown,
    SpeculativeEvent,
    StatusReport,
    StepsJournaled,
    Submit,
    Submitted,
)  # fmt: skip

log = logging.getLogger(__name__)


class Hub:
    # Over 250 lines: the orchestrator's one synchronous core, every inbox's handling in one place
    # (what each message does to the requests is in request.py, closing.py and storage.py).
    def __init__(
        self, config: Config, tokenizer: Tokenizer, context_length: int, tracing: RequestTracing,
        lanes: LaneTable, journal: Journal | None = None,
    ) -> None:  # fmt: skip
        self.config, self.tokenizer, self.context_length = config, tokenizer, context_length
        self.tracing, self.lanes, self.journal = tracing, lanes, journal or Journal()
        self.front = ClientFront(config.timeouts)
        self.ledger = Ledger(config.audit, lanes, self.journal, tracing.count_fault)
        self.changed: set[str] = set()  # requests with new chunks or a result: wake their polls
        self.closing = Closing()  # the supervisor is stopping the pipeline (closing.py)
        self.queue = AdmissionQueue(config.admission)
        self.journaled: dict[str, int] = {}  # steps journaled since the verify lane was last told
        self.finished_in_burst: list[str] = []  # requests `on_burst` finished, in case its commit fails
        self.told: dict[str, int] = {}  # the last journaled step the verify lane heard of, per request
        tracing.cache_capacity(context_length * config.admission.max_running)  # the KV-cache gauge's

    # --- clients ----------------------------------------------------------------------

    def submit(self, msg: Submit, now: float) -> tuple[Submitted | ErrorReply, list[Send]]:
        admitted = self.early_answer(msg) or self.admit(msg)
        if isinstance(admitted, Submitted | ErrorReply):
            return admitted, []
        return self.open(msg, admitted, now)

    def early_answer(self, msg: Submit) -> Submitted | ErrorReply | None:
        """The answer that needs no tokenizing, if there is one: the same request again for a
        repeated idempotency key (the reply to the first Submit was lost), a taken id refused, or
        why no new request can be taken now (checked before the costly `admit`, and again by `open`)."""
        front = self.front
        if (repeat := front.repeated(msg.idempotency_key) or front.taken(msg.request_id)) is not None:
            return repeat
        if (refusal := self.closing.refusal()) is not None:
            return refusal
        if (backlog := self.ledger.backlog()) is not None:
            return ErrorReply(kind="overloaded", message=backlog)
        return self.queue.refusal()

    def admit(self, msg: Submit) -> Admitted | ErrorReply:
        """Tokenize and validate: reads only what never changes, so it may run in a worker thread."""
        return admit(
            msg, self.config.speculation, self.tokenizer, self.context_length,
            has_draft_model=bool(self.config.model.draft_path), has_head=bool(self.config.model.draft_head),
        )  # fmt: skip

    def open(self, msg: Submit, admitted: Admitted, now: float) -> tuple[Submitted | ErrorReply, list[Send]]:
        """The admitted request begins now, or waits its turn (traced as its `queue` span)."""
        if (early := self.early_answer(msg)) is not None:  # a repeat or a refusal that came meanwhile
            return early, []
        request_id, speculation = msg.request_id or uuid.uuid4().hex, admitted.speculation
        trace = self.tracing.start(request_id, msg, admitted.seed, len(admitted.tokens), speculation)
        record = OpenedRecord(
            request_id=request_id, secret=secrets.token_hex(16), owner=msg.owner,
            idempotency_key=msg.idempotency_key, submitted=time.time(), prompt_tokens=admitted.tokens,
            params=msg.params, speculation=speculation, seed=admitted.seed, trace=trace,
        )  # fmt: skip
        self.journal.opened(record)
        machine = self._track(record, now)
        opened = opened_event(record, self.config)
        sends = self._record(opened, now) + self._start(machine, now)
        submitted = Submitted(request_id=request_id, prompt_tokens=len(admitted.tokens), secret=record.secret)
        return submitted, sends

    def _track(self, record: OpenedRecord, now: float) -> RequestMachine:
        """A request machine for a journaled request, known to the client front."""
        started = now - max(time.time() - record.submitted, 0.0)  # on this process's clock
        drafter, model = record.speculation.drafter, self.config.model
        # The verify lane sends the target's features only for a drafter that reads them, and that drafts.
        features = record.speculation.fixed_k != 0 and reads_features(
            drafter, draft_model=bool(model.draft_path), head=bool(model.draft_head)
        )
        who = Identity(
            record.request_id, record.seed, record.speculation, record.trace, started, record.submitted,
            features,
        )  # fmt: skip
        tokens, params = record.prompt_tokens, record.params
        session = Session(self.tokenizer, self.context_length, tokens, params, record.speculation)
        machine = RequestMachine(who, session, self.lanes, self.config.timeouts)
        self.front.add(machine, now, record.secret, record.owner, record.idempotency_key)
        return machine

    def _start(self, machine: RequestMachine, now: float) -> list[Send]:
        """Begin (or, recovered, carry on) now if a running place is free; else it waits its turn."""
        return self._run(machine, machine.resume(now), now) if self.queue.enter(machine.id) else []

    def recover(self, now: float, predecessor: LaneDown | None = None) -> list[Send]:
        """After a restart: every journaled request back as it was when its last step was decided,
        the unacknowledged audit events, the kept faults and the totals; then each running request
        re-primes the verify lane (when it is up) and carries on."""
        journaled = self.journal.recover()
        self.ledger.restore(journaled)
        sends: list[Send] = []
        for request in journaled.requests:
            machine = self._track(request.opened, now)
            machine.replay(request.steps, request.result)
            if request.result is not None:  # only frees the lanes (again)
                self.front.finished(machine.id, now)
                sends += self._run(machine, machine.resume(now), now)
            else:  # in the order they first came: running ones first, waiting ones wait again
                self.tracing.resumed(machine.id, request.opened.trace, len(request.steps))
                sends += self._start(machine, now)
        log.info("recovered %d requests (%d running)", len(journaled.requests), len(self.front.running()))
        if predecessor is not None and self.lanes.update(predecessor, now) == "went_down":
            sends += self._lane_down(predecessor, now)  # its own death, a fault as any lane's
        return sends

    def cancel(self, request_id: str, secret: str, now: float) -> tuple[Chunks | ErrorReply, list[Send]]:
        machine = self.front.owned(request_id, secret)
        if machine is None:
            return unknown(request_id), []
        sends = self._run(machine, machine.cancel(now), now)
        return Chunks(request_id=request_id, chunks=[], done=machine.result), sends

    def status(self) -> StatusReport:
        return StatusReport(
            lanes=self.lanes.statuses(), active_requests=len(self.front.running()) - self.queue.depth,
            queued_requests=self.queue.depth, audit_pending=len(self.ledger.outbox),
            totals=self.ledger.totals, faults=list(self.ledger.faults), **self.closing.fields(),
        )  # fmt: skip

    # --- inboxes ----------------------------------------------------------------------

    def on_data(self, msg: DataInbox | BadMessage, now: float) -> list[Send]:
        if isinstance(msg, Reported):  # several steps in one message: `on_burst` takes them apart
            return self.on_burst([msg], now)
        if isinstance(msg, BadMessage):
            return self._raise("bad_request", "orchestrator", f"data inbox: {msg}", None, now)
        if (machine := self.front.machine(msg.request_id)) is None:
            return []
        return self._run(machine, machine.on_reply(msg, now), now)

    def on_burst(self, msgs: list[DataInbox | BadMessage], now: float) -> list[Send]:
        """What the data inbox held at once (decided steps of several requests, each verify-lane
        report's in one `Reported`), journaled in one transaction. Every send
        comes back only after its commit: StepsJournaled and the audit events never speak of a step
        the journal could still lose, and the lane process wakes the polls that show them only then.
        A commit the disk cannot take (or that fails otherwise) loses the whole burst's steps: the
        requests they belong to end with `storage_full`, as one whose step the journal refused; one
        that had finished in the burst (its client sees it done) keeps its result, which is journaled
        again after the rollback with the audit events not yet acknowledged (each when the disk takes
        it, as outside a burst)."""
        sends: list[Send] = []
        before = dict(self.journaled)
        self.finished_in_burst = []
        try:
            with self.journal.transaction():
                for msg in unreported(msgs):
                    try:
                        sends += self.on_data(msg, now)
                    except (StorageFull, sqlite3.Error):  # the journal's: the burst is lost whole
                        raise
                    except Exception:  # a bug in handling one message costs that message, not the burst
                        log.exception("orchestrator core failed on %s", type(msg).__name__)
        except (StorageFull, sqlite3.Error) as exc:  # another error (a read-only file) loses it alike
            log.warning("the journal could not commit a burst of steps: %s", exc)
            lost = [r for r, step in self.journaled.items() if before.get(r) != step]
            self.journaled = {r: step for r, step in before.items() if r not in lost}
            for request_id in lost:
                if (machine := self.front.machine(request_id)) is not None:
                    sends += self._run(machine, machine.cancel(now, "storage_full"), now)
            self._rejournal()
        if (told := self.journaled_steps()) is not None:
            sends.append(told)
        return sends

    def _rejournal(self) -> None:
        """After a rolled-back burst: what it wrote that memory still holds and a client may have seen
        (the results of requests it finished, the outbox's events), written again."""
        for request_id in self.finished_in_burst:
            if (machine := self.front.machine(request_id)) is not None and machine.result is not None:
                self.journal.finished(request_id, machine.result, time.time())
        self.journal.outbox_restore([(e, data) for e, (data, _) in self.ledger.outbox.pending.items()])

    def journaled_steps(self, force: bool = False) -> Send | None:
        """What the verify lane must hear of the journal: each request's last journaled step since it
        was last told. Not after every burst: only once some request's journal is half its run-ahead
        past what the lane last heard (or a first step), or when `force`d (every tick). A burst of one
        or two steps then costs both processes a message less. A driver goes only `run.run_ahead` steps
        past what it heard: where that many steps take less than a report interval, it stops there for
        this message at each report, in place of the report pause (docs/benchmarks.md, "A longer
        run-ahead")."""
        if not self.journaled:
            return None
        half = max(1, self.config.run.run_ahead // 2)
        told = self.told
        if not force and all(r in told and step - told[r] < half for r, step in self.journaled.items()):
            return None
        steps, self.journaled = self.journaled, {}
        told.update(steps)
        return Send("verify", StepsJournaled(steps=steps))

    def on_control(self, msg: ControlInbox | BadMessage, now: float) -> list[Send]:
        if isinstance(msg, BadMessage):
            return self._raise("bad_request", "orchestrator", f"control inbox: {msg}", None, now)
        if isinstance(msg, Fault):
            return self.ledger.fault(msg, now)
        if isinstance(msg, AuditAck):
            self.ledger.acknowledged(msg.event_ids)
            return []
        if isinstance(msg, Shutdown):
            return self.closing.notice(msg, now, len(self.front.running()))
        change, lane = self.lanes.update(msg, now), self.lanes.views.get(msg.lane)
        if lane is None or change == "ignored":
            return []
        if change in ("went_down", "failed"):
            assert isinstance(msg, LaneDown | LaneFailed)
            return self._lane_down(msg, now)
        sends = self.ledger.snapshot(msg.lane, now)
        if change == "came_up":
            self.tracing.lane_back(msg.lane, lane.pid)
            if msg.lane == "audit":
                sends += self.ledger.audit_lane_back(now)
            if msg.lane == "verify":
                for machine in self.front.running():
                    sends += self._run(machine, machine.verify_lane_up(now), now)
            for machine in self.front.orphaned(msg.lane, msg.pid):  # a gateway before this one is gone
                log.info("%s %d is up: cancelling %s of its predecessor", msg.lane, msg.pid, machine.id)
                sends += self._run(machine, machine.cancel(now), now)
        return sends

    def tick(self, now: float) -> list[Send]:
        """Timeouts, abandoned requests, retention, audit resends, and the step metrics the bursts held
        (`PipelineMetrics.step`); call it often (every 40-100 ms: lanes/ticker.py)."""
        self.tracing.metrics.flush()
        sends: list[Send] = []
        for machine in self.closing.to_end(now, self.front.running()):  # journaled as finished
            sends += self._run(machine, machine.cancel(now, "server_shutdown"), now)
        for machine in self.front.running():
            sends += self._run(machine, machine.tick(now), now)
        for machine in self.front.abandoned(now):
            log.info("client of %s went away: cancelling", machine.id)
            sends += self._run(machine, machine.cancel(now), now)
        for request_id in self.front.forget_expired(now, self.config.admission.max_retained):
            self.journal.forget(request_id)
        for lane in self.lanes.stalled(now, self.config.restart.hang_seconds):
            message = f"no heartbeat for {self.config.restart.hang_seconds:g} s: not counted as up"
            sends += self._raise("timeout", lane, message, None, now)
        if (told := self.journaled_steps(force=True)) is not None:
            sends.append(told)
        return sends + self.ledger.due(now)

    def send_failed(self, send: Send, now: float) -> list[Send]:
        """The lane process could not hand `send` over right now."""
        for event_id in send.event_ids:  # audit events (a batch of them, or one)
            self.ledger.outbox.unsent(event_id)
        return []

    # --- effects ----------------------------------------------------------------------

    def _run(self, machine: RequestMachine, effects: list[Effect], now: float) -> list[Send]:
        sends: list[Send] = []
        for effect in effects:
            if isinstance(effect, Send):
                if effect.lane == "verify":
                    waited = now - machine.who.started if machine.result is None else None  # None: a Close
                    self.tracing.dequeued(machine.id, waited)
                sends.append(effect)
            elif isinstance(effect, Record):
                sends += self._record(effect.event, now)
            elif isinstance(effect, Raise):
                sends += self._raise(effect.kind, effect.lane, effect.message, effect.request_id, now)
            elif isinstance(effect, Journaled):
                try:
                    self.journal.stepped(machine.id, effect.record)
                except StorageFull:  # the disk is full (storage.py): the request ends here, with that reason
                    return sends + self._run(machine, machine.cancel(now, "storage_full"), now)
                self.journaled[machine.id] = effect.record.step
                self.tracing.holds(machine.id, len(machine.session.context))
            elif isinstance(effect, Stepped):
                self.tracing.step(*effect)
            elif isinstance(effect, FirstToken):
                self.tracing.first_token(effect.seconds, machine.id)
        self.changed.add(machine.id)
        tracked = self.front.requests.get(machine.id)
        if machine.result is not None and tracked is not None and tracked.finished_at is None:
            sends += self._finished(machine, now)
            for waiting in self.queue.leave(machine.id):  # its place goes to the oldest waiting
                if (next_machine := self.front.machine(waiting)) is not None:
                    sends += self._run(next_machine, next_machine.resume(now), now)
        return sends

    def _finished(self, machine: RequestMachine, now: float) -> list[Send]:
        result = machine.result
        assert result is not None
        self.told.pop(machine.id, None)  # its driver is closed: nothing more to tell it
        self.journaled.pop(machine.id, None)
        self.front.finished(machine.id, now)
        self.journal.finished(machine.id, result, time.time())
        if self.journal.batching:  # inside `on_burst`'s transaction
            self.finished_in_burst.append(machine.id)
        self.tracing.end(result, now - machine.who.started)
        if result.error is not None:
            return []
        self.ledger.count_run(result.stats.drafted, result.stats.accepted)
        return self._record(summary_event(result), now)

    def _record(self, event: AuditEvent, now: float) -> list[Send]:
        machine = self.front.machine(event.request_id)
        if machine is not None and not event.trace:
            event = msgspec.structs.replace(event, trace=machine.who.trace)  # the audit lane's span joins it
        return self.ledger.record(event, now)

    def _raise(
        self, kind: FaultKind, lane: str, message: str, request_id: str | None, now: float
    ) -> list[Send]:
        """A fault seen here: to the status list, the audit trail, the metrics, and the trace of
        every request it concerns (a lane going down concerns all running ones)."""
        log.warning("fault %s on %s: %s", kind, lane, message)
        machine = self.front.machine(request_id) if request_id is not None else None
        if request_id is not None:
            concerned = [request_id] if machine is not None else []
        else:
            concerned = [m.id for m in self.front.running()] if kind in ("lane_down", "lane_failed") else []
        self.tracing.fault(kind, lane, message, concerned, step=machine.step if machine else None)
        fault = Fault(kind=kind, lane=lane, message=message, request_id=request_id, time=time.time())
        return self.ledger.fault(fault, now)

    def _lane_down(self, msg: LaneDown | LaneFailed, now: float) -> list[Send]:
        """Down or failed, the running requests react alike (plain decoding without drafts, waiting
        for a verify lane); only a lane that will restart opens restart spans for them to close."""
        running, failed = self.front.running(), isinstance(msg, LaneFailed)
        sends = self._raise("lane_failed" if failed else "lane_down", msg.lane, death_message(msg), None, now)
        if not failed:
            self.tracing.lane_down(msg, [m.id for m in running])
        for machine in running:
            sends += self._run(machine, machine.lane_down(msg.lane, now), now)
        for machine in self.front.owned_by(f"{msg.lane}:{msg.pid}"):  # a dead gateway's requests
            log.info("%s died: cancelling its request %s", msg.lane, machine.id)
            sends += self._run(machine, machine.cancel(now), now)
        return sends


def opened_event(record: OpenedRecord, config: Config) -> RequestOpened:
    """The request's first audit event: what `audit verify` needs to re-run it (the model files),
    and the name the model was served under (the HTTP API's model id)."""
    model = config.model
    settings = {
        "params": msgspec.to_builtins(record.params), "drafter": record.speculation.drafter,
        "k": record.speculation.fixed_k, "seed": record.seed, "model": model.path,
        "model_name": config.model_id(), "draft_model": model.draft_path,  # draft_model "": none
    }  # fmt: skip
    return RequestOpened(
        event_id=f"{record.request_id}:opened", request_id=record.request_id, time=record.submitted,
        settings=settings, prompt_tokens=record.prompt_tokens, trace=record.trace,
    )  # fmt: skip


def summary_event(result: Result) -> SpeculativeEvent:
    """The request's last audit event: its speculation figures and the output it was served."""
    stats = result.stats
    return SpeculativeEvent(
        event_id=f"{result.request_id}:summary", request_id=result.request_id, time=time.time(),
        drafted=stats.drafted, accepted=stats.accepted, acceptance_rate=stats.acceptance_rate,
        iterations=stats.steps, content_length=len(result.text), finish_reason=result.finish_reason,
        stats=msgspec.to_builtins(stats), tokens=result.tokens,
    )  # fmt: skip


def death_message(msg: LaneDown | LaneFailed) -> str:
    if isinstance(msg, LaneFailed):
        return f"pid {msg.pid} exited with {msg.returncode}, {msg.restarts} restarts: {msg.reason}"
    return f"pid {msg.pid} exited with {msg.returncode}; restarting"


def unreported(msgs: list[DataInbox | BadMessage]) -> list[DataInbox | BadMessage]:
    """`msgs` with each verify-lane report taken apart into its steps, in order."""
    return [m for got in msgs for m in (got.messages if isinstance(got, Reported) else [got])]
