"""The orchestrator's core: admits requests, routes every reply and control message to its
collaborators, and returns the messages to send. It does no I/O and reads no clock: the
lane process (lanes/orchestrator.py) passes `now` in and sends what comes back, so fast
tests drive whole requests (steps, faults, lane restarts, resume, cancel) with no sockets.

Collaborators, each passed in or built here with what it needs:
- `ClientFront`: the requests clients poll, resume and cancel;
- `RequestMachine`: one request's step protocol;
- `LaneTable`: each lane's state as the control lane reports it;
- `AuditOutbox`: audit events until the audit lane acknowledges them;
- `RequestTracing`: traces and metrics.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid

import msgspec

from pipeline.decoding.session import Session
from pipeline.model.tokenizer import Tokenizer
from pipeline.orchestration.admission import admit
from pipeline.orchestration.audit_outbox import AuditOutbox
from pipeline.orchestration.effects import DraftLaneSlow, Effect, FirstToken, Raise, Record, Send, Stepped
from pipeline.orchestration.front import ClientFront
from pipeline.orchestration.lane_table import LaneTable
from pipeline.orchestration.request import Identity, RequestMachine
from pipeline.orchestration.tracing import RequestTracing
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    AuditAck,
    AuditEvent,
    BadMessage,
    Chunks,
    ControlInbox,
    DataInbox,
    DraftRequest,
    ErrorReply,
    Fault,
    FaultEvent,
    FaultKind,
    LaneDown,
    LaneFailed,
    LaneSnapshot,
    RequestOpened,
    Shutdown,
    SpeculativeEvent,
    SpeculativeState,
    StatusReport,
    Submit,
    Submitted,
    encode,
)  # fmt: skip

log = logging.getLogger(__name__)


class Hub:
    def __init__(
        self,
        config: Config,
        tokenizer: Tokenizer,
        context_length: int,
        tracing: RequestTracing,
        lanes: LaneTable,
    ) -> None:
        self.config, self.tokenizer, self.context_length = config, tokenizer, context_length
        self.tracing, self.lanes = tracing, lanes
        self.front = ClientFront(config.timeouts)
        self.outbox = AuditOutbox()
        self.faults: collections.deque[Fault] = collections.deque(maxlen=200)
        self.totals = SpeculativeState()
        self.changed: set[str] = set()  # requests with new chunks or a result: wake their polls
        self.closing: str | None = None  # the supervisor is stopping the pipeline: admit nothing new
        self.next_resend = 0.0

    # --- clients ----------------------------------------------------------------------

    def submit(self, msg: Submit, now: float) -> tuple[Submitted | ErrorReply, list[Send]]:
        if self.closing is not None:
            return ErrorReply(
                kind="unavailable", message=f"the pipeline is shutting down ({self.closing})"
            ), []
        admitted = admit(
            msg, self.config.speculation, self.tokenizer, self.context_length,
            has_draft_model=bool(self.config.model.draft_path),
        )  # fmt: skip
        if isinstance(admitted, ErrorReply):
            return admitted, []
        request_id, speculation = uuid.uuid4().hex, admitted.speculation
        trace = self.tracing.start(request_id, msg, admitted.seed, len(admitted.tokens), speculation)
        who = Identity(request_id, admitted.seed, speculation.drafter, trace, now, time.time())
        session = Session(self.tokenizer, self.context_length, admitted.tokens, msg.params, speculation)
        machine = RequestMachine(who, session, self.lanes, self.config.timeouts)
        self.front.add(machine, now)
        settings = {
            "params": msgspec.to_builtins(msg.params), "drafter": speculation.drafter,
            "k": speculation.fixed_k, "seed": admitted.seed,
            "model": self.config.model.path, "draft_model": self.config.model.draft_path,  # "": the default
        }  # fmt: skip
        opened = RequestOpened(
            event_id=f"{request_id}:opened", request_id=request_id, time=who.submitted, settings=settings,
            prompt_tokens=admitted.tokens, trace=trace,
        )  # fmt: skip
        sends = self._record(opened, now) + self._run(machine, machine.begin(now), now)
        return Submitted(request_id=request_id, prompt_tokens=len(admitted.tokens)), sends

    def cancel(self, request_id: str, now: float) -> tuple[Chunks | ErrorReply, list[Send]]:
        machine = self.front.machine(request_id)
        if machine is None:
            return ErrorReply(kind="unknown_request", message=f"no request {request_id!r}"), []
        sends = self._run(machine, machine.cancel(now), now)
        return Chunks(request_id=request_id, chunks=[], done=machine.result), sends

    def status(self) -> StatusReport:
        return StatusReport(
            lanes=self.lanes.statuses(), active_requests=len(self.front.running()),
            audit_pending=len(self.outbox), totals=self.totals, faults=list(self.faults),
        )  # fmt: skip

    # --- inboxes ----------------------------------------------------------------------

    def on_data(self, msg: DataInbox | BadMessage, now: float) -> list[Send]:
        if isinstance(msg, BadMessage):
            return self._raise("bad_request", "orchestrator", f"data inbox: {msg}", None, now)
        if isinstance(msg, AuditAck):
            self.outbox.ack(msg.event_ids)
            return []
        machine = self.front.machine(msg.request_id)
        return [] if machine is None else self._run(machine, machine.on_reply(msg, now), now)

    def on_control(self, msg: ControlInbox | BadMessage, now: float) -> list[Send]:
        if isinstance(msg, BadMessage):
            return self._raise("bad_request", "orchestrator", f"control inbox: {msg}", None, now)
        if isinstance(msg, Fault):
            return self._keep_fault(msg, now)
        if isinstance(msg, Shutdown):
            self.closing = msg.reason or "shutdown"
            return []
        change, lane = self.lanes.update(msg, now), self.lanes.views.get(msg.lane)
        if lane is None or change == "ignored":
            return []
        if change in ("went_down", "failed"):
            assert isinstance(msg, LaneDown | LaneFailed)
            return self._lane_down(msg, now)
        sends = self._snapshot(msg.lane, now)
        if change == "came_up":
            self.tracing.lane_back(msg.lane, lane.pid)
            if msg.lane == "audit":
                self.outbox.all_unsent()
                sends += self._resend_audit(now)
            if msg.lane == "verify":
                for machine in self.front.running():
                    sends += self._run(machine, machine.verify_lane_up(now), now)
        return sends

    def tick(self, now: float) -> list[Send]:
        """Timeouts, abandoned requests, retention and audit resends; call it often (every ~50 ms)."""
        sends: list[Send] = []
        for machine in self.front.running():
            sends += self._run(machine, machine.tick(now), now)
        for request_id in self.front.abandoned(now):
            log.info("client of %s went away: cancelling", request_id)
            sends += self.cancel(request_id, now)[1]
        self.front.forget_expired(now)
        for lane in self.lanes.stalled(now, self.config.restart.hang_seconds):
            message = f"no heartbeat for {self.config.restart.hang_seconds:g} s: not counted as up"
            sends += self._raise("timeout", lane, message, None, now)
        if now >= self.next_resend:
            self.next_resend = now + self.config.audit.resend_after / 2
            sends += self._resend_audit(now)
        return sends

    def send_failed(self, send: Send, now: float) -> list[Send]:
        """The lane process could not hand `send` over right now."""
        if send.lane == "audit":
            self.outbox.unsent(send.event_id)
        elif isinstance(send.message, DraftRequest):
            machine = self.front.machine(send.message.request_id)
            if machine is not None:
                return self._run(machine, machine.draft_unsent(now), now)
        return []

    # --- effects ----------------------------------------------------------------------

    def _run(self, machine: RequestMachine, effects: list[Effect], now: float) -> list[Send]:
        sends: list[Send] = []
        for effect in effects:
            if isinstance(effect, Send):
                if effect.lane == "verify":
                    self.tracing.dequeued(machine.id)
                sends.append(effect)
            elif isinstance(effect, Record):
                sends += self._record(effect.event, now)
            elif isinstance(effect, Raise):
                sends += self._raise(effect.kind, effect.lane, effect.message, effect.request_id, now)
            elif isinstance(effect, Stepped):
                self.tracing.step(*effect)
            elif isinstance(effect, FirstToken):
                self.tracing.first_token(effect.seconds)
            elif isinstance(effect, DraftLaneSlow):
                self.lanes.mark_slow("draft", now)
        self.changed.add(machine.id)
        tracked = self.front.requests.get(machine.id)
        if machine.result is not None and tracked is not None and tracked.finished_at is None:
            sends += self._finished(machine, now)
        return sends

    def _finished(self, machine: RequestMachine, now: float) -> list[Send]:
        result = machine.result
        assert result is not None
        self.front.finished(machine.id, now)
        self.tracing.end(result, now - machine.who.started)
        if result.error is not None:
            return []
        stats = machine.session.stats
        self.totals.runs += 1
        self.totals.drafted += stats.drafted
        self.totals.accepted += stats.accepted
        summary = SpeculativeEvent(
            event_id=f"{machine.id}:summary", request_id=machine.id, time=time.time(),
            drafted=stats.drafted, accepted=stats.accepted, acceptance_rate=stats.acceptance_rate,
            iterations=stats.steps, content_length=len(result.text), finish_reason=result.finish_reason,
            stats=msgspec.to_builtins(result.stats), tokens=result.tokens,
        )  # fmt: skip
        return self._record(summary, now)

    def _record(self, event: AuditEvent, now: float) -> list[Send]:
        machine = self.front.machine(event.request_id)
        if machine is not None and not event.trace:
            event = msgspec.structs.replace(event, trace=machine.who.trace)  # the audit lane's span joins it
        data, up = encode(event), self.lanes.is_up("audit")
        self.outbox.add(event.event_id, data, now if up else None)
        return [Send("audit", data, event.event_id)] if up else []

    def _keep_fault(self, fault: Fault, now: float) -> list[Send]:
        self.faults.append(fault)
        event = FaultEvent(
            event_id=f"fault:{uuid.uuid4().hex}",
            request_id=fault.request_id or "",
            time=fault.time or time.time(),
            fault=fault,
        )
        return self._record(event, now)

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
        return self._keep_fault(fault, now)

    def _lane_down(self, msg: LaneDown | LaneFailed, now: float) -> list[Send]:
        """Down or failed, the running requests react alike (plain decoding without drafts, waiting
        for a verify lane); only a lane that will restart opens restart spans for them to close."""
        running = self.front.running()
        if isinstance(msg, LaneFailed):
            message = f"pid {msg.pid} exited with {msg.returncode}, {msg.restarts} restarts: {msg.reason}"
            sends = self._raise("lane_failed", msg.lane, message, None, now)
        else:
            message = f"pid {msg.pid} exited with {msg.returncode}; restarting"
            sends = self._raise("lane_down", msg.lane, message, None, now)
            self.tracing.lane_down(msg, [m.id for m in running])
        for machine in running:
            sends += self._run(machine, machine.lane_down(msg.lane, now), now)
        return sends

    def _snapshot(self, name: str, now: float) -> list[Send]:
        """The lane's heartbeat totals into the audit trail, at most every audit.snapshot_seconds."""
        lane, every = self.lanes[name], self.config.audit.snapshot_seconds
        if every <= 0 or now - lane.snapshot_at < every:
            return []
        lane.snapshot_at = now
        snapshot = LaneSnapshot(
            event_id=f"lane:{name}:{uuid.uuid4().hex}", request_id="", time=time.time(), lane=name,
            pid=lane.pid, restarts=lane.restarts, lane_state=lane.state,
            totals=self.totals if name == "orchestrator" else lane.totals,
        )  # fmt: skip
        return self._record(snapshot, now)

    def _resend_audit(self, now: float) -> list[Send]:
        if not self.lanes.is_up("audit"):
            return []
        return [
            Send("audit", data, event_id)
            for event_id, data in self.outbox.due(now, self.config.audit.resend_after)
        ]
