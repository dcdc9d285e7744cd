"""The orchestrator: the hub and the single owner of every request's accepted tokens.

Each request is one trio task driving the same `Session` the in-process decoder uses:
ask the draft lane for k tokens, have the verify lane decide them, stream what was
accepted. Faults only cost speed: a draft lane that is down or slow turns steps into
plain decoding; a verify lane that restarts is re-primed from the accepted prefix; an
audit lane that restarts gets every unacknowledged event again.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pynng
import trio
from opentelemetry.trace import Span, SpanKind

from .config import Config
from .drafters.registry import DRAFTERS
from .lane import LaneContext, lane_main
from .messages import (
    AuditAck,
    AuditEvent,
    BadMessage,
    Cancel,
    Chunk,
    Chunks,
    ClientRequest,
    Close,
    Codec,
    ControlInbox,
    DataInbox,
    Drafted,
    DraftRequest,
    ErrorReply,
    Fault,
    FaultEvent,
    FaultKind,
    Heartbeat,
    LaneDown,
    LaneSnapshot,
    LaneStatus,
    LaneUp,
    Message,
    Open,
    Opened,
    Poll,
    RequestOpened,
    Rows,
    SpeculativeEvent,
    SpeculativeState,
    StatusQuery,
    StatusReport,
    StepEvent,
    StepFailed,
    Submit,
    Submitted,
    Verified,
    Verify,
    encode,
)
from .metrics import PipelineMetrics
from .model.default import default_model_path
from .model.store import load_prepared
from .prompts import prompt_tokens
from .sampling import make_rng
from .speculative import Session
from .telemetry import carrier, fail
from .tokenizer import Tokenizer
from .transport import Inbox, Outbox, listen

log = logging.getLogger(__name__)

LANE_DOWN = object()  # wakes a step waiting on a lane that went down


class RequestFailed(Exception):
    def __init__(self, kind: FaultKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class Slot:
    def __init__(self, lane: str) -> None:
        self.lane, self.event, self.value = lane, trio.Event(), None

    def resolve(self, value: object) -> None:
        if not self.event.is_set():
            self.value = value
            self.event.set()


@dataclass
class LaneView:
    name: str
    state: str = "starting"
    pid: int | None = None
    restarts: int = 0
    totals: SpeculativeState = field(default_factory=SpeculativeState)
    last_beat: float = 0.0
    slow_since: float | None = None  # a draft timed out; skip drafting until a newer heartbeat
    dead_pids: set[int] = field(default_factory=set)
    runtime: dict[str, Any] = field(default_factory=dict)
    up: trio.Event = field(default_factory=trio.Event)
    snapshot_at: float = -math.inf  # when its totals last went to the audit trail

    def usable(self) -> bool:
        return self.state == "up" and (self.slow_since is None or self.last_beat > self.slow_since)

    def status(self) -> LaneStatus:
        return LaneStatus(
            name=self.name,
            state=self.state,
            pid=self.pid,
            restarts=self.restarts,
            active_requests=self.totals.active_requests,
            totals=self.totals,
            runtime=self.runtime,
        )


@dataclass
class Request:
    id: str
    session: Session
    seed: int
    drafter: str
    submitted: float
    chunks: list[Chunk] = field(default_factory=list)
    done: dict[str, Any] | None = None
    changed: trio.Event = field(default_factory=trio.Event)
    last_poll: float = field(default_factory=time.monotonic)
    pollers: int = 0  # polls waiting right now: a client in a long poll is not idle
    finished_at: float | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    step: int = 0  # the last completed step
    draws: int = 0  # uniforms the verifier has spent for this request
    span: Span | None = None  # the request's root span; every lane's spans hang under it
    trace: dict[str, str] = field(default_factory=dict)  # its W3C context, carried by every message

    def push(self, text: str, tokens: list[int]) -> None:
        if text or tokens:
            self.chunks.append(Chunk(len(self.chunks), text, tokens))
            self.notify()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class Orchestrator:
    def __init__(self, config: Config, tokenizer: Tokenizer, context_length: int, lane: LaneContext) -> None:
        self.config, self.tokenizer, self.context_length, self.lane = config, tokenizer, context_length, lane
        self.lanes = {name: LaneView(name) for name in ("verify", "draft", "audit", "orchestrator")}
        if "gateway" in config.processes():  # started next to us: readiness waits for it too
            self.lanes["gateway"] = LaneView("gateway")
        self.requests: dict[str, Request] = {}
        self.waiters: dict[tuple[str, str, int], Slot] = {}
        self.outbox: dict[str, tuple[bytes, float]] = {}  # audit events not yet acknowledged
        self.faults: collections.deque[Fault] = collections.deque(maxlen=200)
        self.totals = SpeculativeState()
        self.verify_out = Outbox(config.addresses.verify)
        self.draft_out = Outbox(config.addresses.draft)
        self.audit_out = Outbox(config.addresses.audit)
        self.nursery: trio.Nursery | None = None
        self.telemetry = lane.telemetry
        self.model_id = config.model_id()
        self.metrics = PipelineMetrics(lane.telemetry.meter, self.model_id)
        self.restart_spans: dict[str, list[Span]] = {}  # per lane: active requests waiting out its restart

    # --- faults and the audit outbox --------------------------------------------------

    def fault(self, fault: Fault) -> None:
        self.faults.append(fault)
        event_id = f"fault:{uuid.uuid4().hex}"
        self.audit(
            FaultEvent(event_id=event_id, request_id=fault.request_id or "", time=time.time(), fault=fault)
        )

    def raise_fault(self, kind: FaultKind, lane: str, message: str, request_id: str | None = None) -> None:
        """A fault seen here: to the status list, the audit trail, the metrics, and the trace of
        every request it concerns (a lane going down concerns all running ones)."""
        log.warning("fault %s on %s: %s", kind, lane, message)
        self.fault(Fault(kind=kind, lane=lane, message=message, request_id=request_id, time=time.time()))
        self.metrics.fault(kind, lane)
        if request_id is not None:
            concerned = [self.requests[request_id]] if request_id in self.requests else []
        else:
            concerned = self.running() if kind == "lane_down" else []
        for req in concerned:
            self.telemetry.fault(req.span, kind, lane, message, request_id=req.id, step=req.step)
        if not concerned:
            self.telemetry.fault(None, kind, lane, message, request_id=request_id)

    def running(self) -> list[Request]:
        return [req for req in self.requests.values() if req.done is None]

    def audit(self, event: AuditEvent) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and not event.trace:
            event = msgspec.structs.replace(event, trace=req.trace)  # the audit lane's span joins the trace
        data = encode(event)
        sent = self.audit_out.put_bytes_nowait(data) if self.lanes["audit"].state == "up" else False
        self.outbox[event.event_id] = (data, time.monotonic() if sent else -math.inf)

    def snapshot(self, lane: LaneView) -> None:
        """Record the lane's heartbeat totals in the audit trail, at most every audit.snapshot_seconds."""
        every, now = self.config.audit.snapshot_seconds, time.monotonic()
        if every <= 0 or now - lane.snapshot_at < every:
            return
        lane.snapshot_at = now
        totals = self.totals if lane.name == "orchestrator" else lane.totals
        self.audit(
            LaneSnapshot(
                event_id=f"lane:{lane.name}:{uuid.uuid4().hex}", request_id="", time=time.time(),
                lane=lane.name, pid=lane.pid, restarts=lane.restarts, lane_state=lane.state,
                totals=totals,
            )
        )  # fmt: skip

    async def resend_audit(self) -> None:
        while True:
            await trio.sleep(self.config.audit.resend_after / 2)
            if self.lanes["audit"].state != "up":
                continue
            cutoff = time.monotonic() - self.config.audit.resend_after
            for event_id, (data, sent) in list(self.outbox.items()):
                if sent < cutoff:
                    if not self.audit_out.put_bytes_nowait(data):
                        break
                    self.outbox[event_id] = (data, time.monotonic())

    # --- lane calls -------------------------------------------------------------------

    def expect(self, key: tuple[str, str, int], lane: str) -> Slot:
        slot = self.waiters[key] = Slot(lane)
        return slot

    async def call_verify(self, req: Request, msg: Open | Verify) -> Opened | Verified:
        """Until the verify lane answers: re-send on timeout or restart, re-prime if it lost the request."""
        kind = "open" if isinstance(msg, Open) else "verify"
        key = (req.id, kind, msg.step)
        timeout = self.config.timeouts.verify
        if isinstance(msg, Open):
            timeout += self.config.timeouts.prefill_per_token * len(msg.tokens)
        lane = self.lanes["verify"]
        while True:
            await lane.up.wait()
            slot = self.expect(key, "verify")
            try:
                await self.verify_out.put(msg, timeout=self.config.timeouts.send)
                with trio.move_on_after(timeout):
                    await slot.event.wait()
            except trio.TooSlowError:
                pass
            finally:
                self.waiters.pop(key, None)
            value = slot.value
            if value is None:
                self.raise_fault(
                    "timeout", "verify", f"no answer to {kind} step {msg.step}; re-sending", req.id
                )
            elif value is LANE_DOWN:
                continue
            elif isinstance(value, StepFailed):
                if value.kind != "unknown_request":
                    raise RequestFailed(value.kind, value.message)
                await self.reprime(req)
            else:
                return value  # type: ignore[return-value]

    async def reprime(self, req: Request) -> None:
        """Rebuild the verifier's state from the accepted prefix (all but the pending token)."""
        session = req.session
        log.info("re-priming %s at step %d (%d tokens)", req.id, req.step, len(session.context) - 1)
        await self.call_verify(
            req,
            Open(
                request_id=req.id, step=req.step, tokens=session.context[:-1], params=session.params,
                seed=req.seed, draws=req.draws, sample=False, capacity=session.capacity(), trace=req.trace,
            ),
        )  # fmt: skip

    async def call_draft(self, req: Request, step: int, k: int) -> Drafted | None:
        """A proposal, or None: lane down, slow or failing means this step decodes plainly."""
        lane = self.lanes["draft"]
        if not lane.usable():
            return None
        session = req.session
        msg = DraftRequest(
            request_id=req.id, step=step, drafter=req.drafter, params=session.params, seed=req.seed,
            prompt_length=len(session.prompt_tokens), context=session.context, k=k, trace=req.trace,
        )  # fmt: skip
        key = (req.id, "draft", step)
        slot = self.expect(key, "draft")
        try:
            if not self.draft_out.put_nowait(msg):
                return None
            with trio.move_on_after(self.config.timeouts.draft):
                await slot.event.wait()
        finally:
            self.waiters.pop(key, None)
        if slot.value is None:
            lane.slow_since = time.monotonic()
            self.raise_fault(
                "timeout", "draft", f"no draft for step {step} in time; decoding plainly", req.id
            )
        return slot.value if isinstance(slot.value, Drafted) else None

    # --- one request ------------------------------------------------------------------

    async def drive(self, req: Request) -> None:
        session, started = req.session, time.perf_counter()
        prefill_seconds = 0.0
        try:
            with req.scope:
                with self.telemetry.span("queue", req.span):  # until a verify lane is up
                    await self.lanes["verify"].up.wait()
                opened = await self.call_verify(
                    req,
                    Open(
                        request_id=req.id, step=0, tokens=session.prompt_tokens, params=session.params,
                        seed=req.seed, capacity=session.capacity(), trace=req.trace,
                    ),
                )  # fmt: skip
                prefill_seconds = time.perf_counter() - started
                self.metrics.first_token(time.time() - req.submitted)
                assert isinstance(opened, Opened) and opened.token is not None
                req.draws = opened.draws
                self.emit(req, session.start(opened.token), 0)
                self.audit_step(req, 0, "", 0, [], opened.token, opened)
                while (want := session.plan()) is not None:
                    await self.step(req, want)
                self.emit(req, session.finish_text(), len(session.out.tokens))
                if session.out.finish_reason == "max_iterations_exceeded":
                    self.raise_fault(
                        "max_iterations_exceeded", "orchestrator", "ended after the step limit", req.id
                    )
        except RequestFailed as exc:
            self.raise_fault(exc.kind, "verify", exc.message, req.id)
            self.finish(
                req,
                {
                    "request_id": req.id,
                    "finish_reason": "error",
                    "error": {"kind": exc.kind, "message": exc.message},
                },
            )
            return
        finally:
            self.release(req)
        if req.done is None:
            wall = time.perf_counter() - started
            reason = "cancelled" if req.scope.cancelled_caught else None
            completion = session.completion(
                wall=wall, prefill_seconds=prefill_seconds, seed=req.seed, drafter=req.drafter
            )
            done = {**msgspec.to_builtins(completion), "request_id": req.id}
            if reason:
                done["finish_reason"] = reason
            self.finish(req, done)
            self.summarise(req, done)

    async def step(self, req: Request, want: int) -> None:
        session = req.session
        step = req.step + 1
        t0 = time.perf_counter()
        proposal = await self.call_draft(req, step, want) if want > 0 else None
        draft_seconds = time.perf_counter() - t0 if proposal else 0.0
        drafts: list[int] = []
        rows: Rows | None = None
        if proposal is not None:
            drafts = proposal.tokens[:want]
            if proposal.probs is not None and proposal.probs.shape[0] >= len(drafts):
                rows = Rows.of(proposal.probs.array()[: len(drafts)])
            elif proposal.probs is not None:
                drafts = []
        t0 = time.perf_counter()
        verified = await self.call_verify(
            req,
            Verify(
                request_id=req.id, step=step, position=len(session.context) - 1,
                pending=session.context[-1], drafts=drafts, draft_probs=rows if drafts else None,
                trace=req.trace,
            ),
        )  # fmt: skip
        assert isinstance(verified, Verified)
        verify_seconds = time.perf_counter() - t0
        before = len(session.out.tokens)
        text = session.record(len(drafts), verified.tokens, verified.accepted, draft_seconds, verify_seconds)
        req.step, req.draws = step, verified.draws
        self.emit(req, text, before)
        drafter = proposal.drafter if proposal else ""
        self.metrics.step(drafter, len(drafts), verified.accepted, draft_seconds, verify_seconds)
        self.audit_step(req, step, drafter, want, drafts, None, verified)

    def emit(self, req: Request, text: str, before: int) -> None:
        req.push(text, req.session.out.tokens[before:])

    def audit_step(
        self,
        req: Request,
        step: int,
        drafter: str,
        k: int,
        drafts: list[int],
        first: int | None,
        reply: Opened | Verified,
    ) -> None:
        is_open = isinstance(reply, Opened)
        self.audit(
            StepEvent(
                event_id=f"{req.id}:step:{step}", request_id=req.id, time=time.time(), step=step,
                drafter=drafter, k=k, drafted=drafts,
                emitted=[first] if is_open and first is not None else list(getattr(reply, "tokens", [])),
                decisions=[] if is_open else reply.decisions,  # type: ignore[union-attr]
                final_u=reply.u if is_open else reply.final_u,  # type: ignore[union-attr]
                draws=reply.draws, batch_size=1 if is_open else reply.batch_size,  # type: ignore[union-attr]
                backend=reply.backend,
            )
        )  # fmt: skip

    def finish(self, req: Request, done: dict[str, Any]) -> None:
        req.done, req.finished_at = done, time.monotonic()
        req.notify()
        self.end_trace(req, done)

    def summarise(self, req: Request, done: dict[str, Any]) -> None:
        stats = req.session.stats
        self.totals.runs += 1
        self.totals.drafted += stats.drafted
        self.totals.accepted += stats.accepted
        self.audit(
            SpeculativeEvent(
                event_id=f"{req.id}:summary", request_id=req.id, time=time.time(),
                drafted=stats.drafted, accepted=stats.accepted,
                acceptance_rate=stats.accepted / stats.drafted if stats.drafted else 0.0,
                iterations=stats.steps, content_length=len(done.get("text", "")),
                finish_reason=done["finish_reason"], stats=done.get("stats", {}),
                tokens=done.get("tokens", []),
            )
        )  # fmt: skip

    def release(self, req: Request) -> None:
        """Free the lanes' state for the request (best effort: lanes also expire idle state)."""
        self.verify_out.put_nowait(Close(request_id=req.id))
        self.draft_out.put_nowait(Close(request_id=req.id, context=req.session.context))

    # --- clients ----------------------------------------------------------------------

    def admit(self, msg: Submit) -> Submitted | ErrorReply:
        spec = self.config.speculation
        drafter = msg.drafter or spec.drafter
        if drafter not in DRAFTERS:
            return ErrorReply(
                kind="bad_request", message=f"unknown drafter {drafter!r} (choose from {', '.join(DRAFTERS)})"
            )
        if drafter == "model" and not self.config.model.draft_path:
            return ErrorReply(
                kind="bad_request", message="the model drafter needs model.draft_path in the configuration"
            )
        k = msg.k if msg.k is not None else (None if spec.k == "auto" else spec.k)
        if k is not None and not 0 <= k <= 32:
            return ErrorReply(kind="bad_request", message=f"k must be 0..32, got {k}")
        if drafter == "none":
            k = 0
        max_iterations = (
            msg.max_iterations if msg.max_iterations is not None else (spec.max_iterations or None)
        )
        if max_iterations is not None and max_iterations < 1:
            return ErrorReply(kind="bad_request", message="max_iterations must be >= 1")
        try:
            tokens = prompt_tokens(self.tokenizer, msg.prompt, chat=msg.chat, messages=msg.messages)
        except (ValueError, KeyError, TypeError) as exc:
            return ErrorReply(kind="bad_request", message=f"cannot build the prompt: {exc}")
        if not tokens:
            return ErrorReply(kind="bad_request", message="the prompt is empty")
        if len(tokens) >= self.context_length:
            return ErrorReply(
                kind="prompt_too_long",
                message=f"the prompt has {len(tokens)} tokens; the model's context is {self.context_length}, "
                "which leaves no room to generate",
            )
        _, seed = make_rng(msg.params.seed)
        session = Session(
            self.tokenizer, self.context_length, tokens, msg.params,
            k=k, k_max=spec.k_max, max_iterations=max_iterations,
        )  # fmt: skip
        req = Request(uuid.uuid4().hex, session, seed, drafter, time.time())
        self.requests[req.id] = req
        self.start_trace(req, msg, k)
        settings = {
            "params": msgspec.to_builtins(msg.params), "drafter": drafter, "k": k, "seed": seed,
            "model": self.config.model.path, "draft_model": self.config.model.draft_path,  # "": the default
        }  # fmt: skip
        self.audit(
            RequestOpened(
                event_id=f"{req.id}:opened",
                request_id=req.id,
                time=req.submitted,
                settings=settings,
                prompt_tokens=tokens,
            )
        )
        assert self.nursery is not None
        self.nursery.start_soon(self.drive, req)
        return Submitted(request_id=req.id, prompt_tokens=len(tokens))

    def start_trace(self, req: Request, msg: Submit, k: int | None) -> None:
        """The request's root span (under the caller's, if it sent one), in GenAI conventions."""
        params, operation = msg.params, "chat" if msg.chat or msg.messages is not None else "text_completion"
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "speclanes",
            "gen_ai.request.model": self.model_id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
            "gen_ai.request.seed": req.seed,
            "gen_ai.usage.input_tokens": len(req.session.prompt_tokens),
            "gen_ai.response.id": req.id,
            "speclanes.request_id": req.id,
            "speclanes.drafter": req.drafter,
            "speclanes.k": "auto" if k is None else str(k),
        }
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        name = f"{operation} {self.model_id}"
        req.span = self.telemetry.start(name, msg.trace, attributes, kind=SpanKind.SERVER)
        req.trace = carrier(req.span)
        self.metrics.admitted(len(req.session.prompt_tokens))

    def end_trace(self, req: Request, done: dict[str, Any]) -> None:
        span, reason = req.span, done.get("finish_reason", "")
        seconds = time.time() - req.submitted
        self.metrics.finished(len(req.session.out.tokens), seconds, reason)
        if span is None:
            return
        stats = req.session.stats.as_dict()
        span.set_attributes(
            {
                "gen_ai.usage.output_tokens": len(req.session.out.tokens),
                "gen_ai.response.finish_reasons": [reason],
                **{f"speclanes.{key}": stats[key] for key in ("steps", "drafted", "accepted")},
                "speclanes.acceptance": stats["acceptance_rate"],
                "speclanes.mean_accepted_length": stats["mean_accepted_length"],
            }
        )
        if "error" in done:
            fail(span, f"{done['error']['kind']}: {done['error']['message']}")
        span.end()

    async def poll(self, msg: Poll) -> Chunks | ErrorReply:
        req = self.requests.get(msg.request_id)
        if req is None:
            return ErrorReply(
                kind="unknown_request", message=f"no request {msg.request_id!r} (finished long ago?)"
            )
        wait = min(max(msg.wait, 0.0), self.config.timeouts.poll_wait_max)
        req.pollers += 1
        try:
            if len(req.chunks) <= msg.after + 1 and req.done is None:
                with trio.move_on_after(wait):
                    await req.changed.wait()
        finally:
            req.pollers -= 1
            req.last_poll = time.monotonic()
        return Chunks(request_id=req.id, chunks=req.chunks[max(msg.after + 1, 0) :], done=req.done)

    def status(self) -> StatusReport:
        return StatusReport(
            lanes=[lane.status() for lane in self.lanes.values()],
            active_requests=sum(1 for r in self.requests.values() if r.done is None),
            audit_pending=len(self.outbox),
            totals=self.totals,
            faults=list(self.faults),
        )

    async def answer(self, data: bytes) -> Message:
        try:
            msg = self.client_codec.decode(data)
        except BadMessage as exc:
            return ErrorReply(kind="bad_request", message=str(exc))
        if isinstance(msg, Submit):
            return self.admit(msg)
        if isinstance(msg, Poll):
            return await self.poll(msg)
        if isinstance(msg, Cancel):
            req = self.requests.get(msg.request_id)
            if req is None:
                return ErrorReply(kind="unknown_request", message=f"no request {msg.request_id!r}")
            req.scope.cancel()
            return Chunks(request_id=req.id, chunks=[], done=req.done)
        assert isinstance(msg, StatusQuery)
        return self.status()

    async def serve_client(self, sock: pynng.Socket, idle: list[int]) -> None:
        """One Rep context; starts another when it is the last idle one, so long polls never
        starve new clients."""
        ctx = sock.new_context()
        try:
            while True:
                idle[0] += 1
                data = await ctx.arecv()
                idle[0] -= 1
                if idle[0] == 0:
                    assert self.nursery is not None
                    self.nursery.start_soon(self.serve_client, sock, idle)
                try:
                    reply = await self.answer(data)
                except Exception as exc:  # a bug must cost one reply, not the service
                    log.exception("client request failed")
                    reply = ErrorReply(kind="internal", message=repr(exc))
                await ctx.asend(encode(reply))
        finally:
            ctx.close()

    async def reap(self) -> None:
        """Cancel requests nobody polls any more; forget finished ones after the retention time."""
        timeouts = self.config.timeouts
        while True:
            await trio.sleep(0.25)
            now = time.monotonic()
            for req in list(self.requests.values()):
                if req.done is None and not req.pollers and now - req.last_poll > timeouts.client_idle:
                    log.info("client of %s went away: cancelling", req.id)
                    req.scope.cancel()
                elif req.finished_at is not None and now - req.finished_at > timeouts.retain:
                    del self.requests[req.id]

    # --- inboxes ----------------------------------------------------------------------

    async def receive_data(self, inbox: Inbox) -> None:
        async for msg in inbox:
            if isinstance(msg, BadMessage):
                self.raise_fault("bad_request", "orchestrator", f"data inbox: {msg}")
            elif isinstance(msg, AuditAck):
                for event_id in msg.event_ids:
                    self.outbox.pop(event_id, None)
            else:
                kind = {Opened: "open", Verified: "verify", Drafted: "draft"}.get(type(msg))
                kind = kind or msg.origin  # type: ignore[union-attr]
                slot = self.waiters.get((msg.request_id, kind, msg.step))
                if slot is not None:  # no slot: a late or repeated answer, already dealt with
                    slot.resolve(msg)

    async def receive_control(self, inbox: Inbox) -> None:
        async for msg in inbox:
            if isinstance(msg, LaneUp | LaneDown | Heartbeat) and msg.lane == "gateway":
                self.lanes.setdefault("gateway", LaneView("gateway"))  # one started on another host
            if isinstance(msg, BadMessage):
                self.raise_fault("bad_request", "orchestrator", f"control inbox: {msg}")
            elif isinstance(msg, Fault):
                self.fault(msg)
            elif isinstance(msg, LaneUp) and msg.lane in self.lanes:
                lane = self.lanes[msg.lane]
                lane.pid, lane.restarts = msg.pid, msg.restarts
                if lane.state != "up":
                    lane.state = "starting"
            elif isinstance(msg, LaneDown) and msg.lane in self.lanes:
                self.lane_down(msg)
            elif isinstance(msg, Heartbeat) and msg.lane in self.lanes:
                lane = self.lanes[msg.lane]
                if msg.pid in lane.dead_pids:
                    continue
                came_up = lane.state != "up"
                lane.state, lane.pid, lane.totals, lane.last_beat = "up", msg.pid, msg.state, time.monotonic()
                lane.runtime = msg.runtime
                lane.up.set()
                self.snapshot(lane)
                if came_up:
                    self.lane_back(lane)
                if came_up and msg.lane == "audit":
                    self.outbox = {k: (data, -math.inf) for k, (data, _) in self.outbox.items()}

    def lane_down(self, msg: LaneDown) -> None:
        lane = self.lanes[msg.lane]
        lane.dead_pids.add(msg.pid)
        lane.state, lane.restarts, lane.up = "down", msg.restarts, trio.Event()
        self.raise_fault("lane_down", msg.lane, f"pid {msg.pid} exited with {msg.returncode}; restarting")
        for slot in list(self.waiters.values()):
            if slot.lane == msg.lane:
                slot.resolve(LANE_DOWN)
        attributes = {
            "speclanes.lane": msg.lane, "speclanes.lane.pid": msg.pid, "speclanes.lane.restarts": msg.restarts
        }  # fmt: skip
        waiting = self.restart_spans.setdefault(msg.lane, [])
        for req in self.running():  # each running request's trace shows the restart it lived through
            waiting.append(self.telemetry.start(f"lane restart {msg.lane}", req.span, attributes))

    def lane_back(self, lane: LaneView) -> None:
        """A lane reports in again: close the restart spans of the requests that saw it go."""
        for span in self.restart_spans.pop(lane.name, []):
            span.set_attribute("speclanes.lane.new_pid", lane.pid or 0)
            span.end()

    async def run(self) -> None:
        config = self.config
        self.client_codec: Codec[Any] = Codec(ClientRequest)
        data = Inbox(config.bind("data"), DataInbox)
        control = Inbox(config.bind("control"), ControlInbox)
        clients = listen(pynng.Rep0, config.bind("client"))
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self.receive_data, data)
            nursery.start_soon(self.receive_control, control)
            nursery.start_soon(self.resend_audit)
            nursery.start_soon(self.reap)
            nursery.start_soon(self.serve_client, clients, [0])


async def serve(lane: LaneContext) -> None:
    config = lane.config
    cfg, _, tokenizer = load_prepared(config.model.path or default_model_path())  # weights stay unmapped
    await Orchestrator(config, tokenizer, cfg.context_length, lane).run()


def main() -> None:
    lane_main("orchestrator", serve)


if __name__ == "__main__":
    main()
