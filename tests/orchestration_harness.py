"""The whole pipeline in one process with no sockets: the orchestrator's `Hub` wired to a real
verify lane core (`VerifyCore`: the drivers and the `Verifier`) and `DraftServer` on a tiny model,
with a test-controlled clock, lost messages and lane restarts. Every message still goes through its
msgspec encoding, as on a socket; the verify lane runs forwards until it has nothing queued, as its
loop does."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec
from opentelemetry.sdk.metrics.export import MetricReader

from pipeline.decoding.drafters.registry import make_draft_sources, split_by_lane
from pipeline.decoding.result import Result
from pipeline.model import Runtime
from pipeline.model.draft_head import DraftHead
from pipeline.observability.metrics import PipelineMetrics
from pipeline.observability.process_stats import ProcessStats
from pipeline.orchestration.effects import Send, batched
from pipeline.orchestration.hub import Hub
from pipeline.orchestration.journal import Journal
from pipeline.orchestration.lane_table import LaneTable
from pipeline.orchestration.tracing import RequestTracing, gauges_of
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    AuditAck,
    AuditBatch,
    AuditEvent,
    AuditInbox,
    AuditLaneInbox,
    Codec,
    DataInbox,
    DraftInbox,
    Heartbeat,
    LaneDown,
    LaneFailed,
    Reported,
    SpeculativeState,
    Submit,
    Submitted,
    VerifyInbox,
    encode,
)
from pipeline.workers.draft_server import DraftServer
from pipeline.workers.driver import Out
from pipeline.workers.verifier import Verifier
from pipeline.workers.verify_core import VerifyCore

from .telemetry_harness import MemoryTelemetry


class FakeLane:
    """What the lane cores use of a LaneContext: fault reports and the running totals."""

    def __init__(self) -> None:
        self.state = SpeculativeState()
        self.faults: list[tuple[str, str, str | None, int | None]] = []
        self.telemetry = MemoryTelemetry()

    def fault(
        self,
        kind: str,
        message: str,
        request_id: str | None = None,
        step: int | None = None,
        trace: dict[str, str] | None = None,
    ) -> None:
        self.faults.append((kind, message, request_id, step))


PROCESS = ProcessStats.measure()  # every lane's heartbeat carries figures, as a real one's does
CODECS = {"verify": Codec(VerifyInbox), "draft": Codec(DraftInbox), "audit": Codec(AuditLaneInbox)}
EVENTS: Codec = Codec(AuditInbox)
REPLIES: Codec = Codec(DataInbox)


@dataclass
class World:
    model: Runtime
    config: Config = field(default_factory=Config)
    now: float = 100.0
    in_flight: deque[Send] = field(default_factory=deque)
    lost: set[str] = field(default_factory=set)  # lanes whose inbound messages vanish
    beating: set[str] = field(default_factory=set)  # lanes up and not frozen: they beat as time passes
    audited: dict[str, AuditEvent] = field(default_factory=dict)
    sent: list[Send] = field(default_factory=list)
    to_verifier: list[msgspec.Struct] = field(default_factory=list)  # what the drivers asked of the verifier
    secrets: dict[str, str] = field(default_factory=dict)  # what each Submit was answered with
    journal_path: str = ":memory:"  # a file, for tests that restart the orchestrator
    orchestrator_dead: bool = False  # replies sent now are lost with it
    burst_replies: bool = False  # the steps of every forward till the lane idles reach it as one burst
    reported: list[msgspec.Struct] = field(default_factory=list)  # those steps, until then
    pids: dict[str, int] = field(
        default_factory=lambda: {"verify": 10, "draft": 20, "audit": 30, "orchestrator": 40}
    )

    readers: list[MetricReader] = field(default_factory=list)  # more metric readers for the hub's instruments
    head: DraftHead | None = None  # the draft lane's head (the hub knows of it by `model.draft_head`)
    forward_seconds: float = 0.0  # how long each of the verify lane's forwards takes, on `now`'s clock

    @classmethod
    def paced(cls, model: Runtime, settings: dict | None = None, **fields: object) -> World:
        """A world whose drafts go through the draft lane (`run.draft_in_verify_lane` false): each
        step's proposal is a delivery of its own, so `run(until=N)` stops mid-request and the draft
        lane's faults can be staged (drafting in the verify lane, a request's steps can all run within
        one delivery)."""
        settings = settings or {}
        run = {**settings.get("run", {}), "draft_in_verify_lane": False}
        world = cls(model, config=msgspec.convert({**settings, "run": run}, Config), **fields)  # type: ignore[arg-type]
        return world

    def __post_init__(self) -> None:
        self.telemetry = MemoryTelemetry(self.readers)
        self.hub = self.new_hub()
        self.core = self.new_core()
        self.drafts = self.new_draft_server()

    @property
    def verifier(self) -> Verifier:
        return self.core.verifier

    def new_core(self) -> VerifyCore:
        """As the verify lane builds it: with the drafters it runs itself (`run.draft_in_verify_lane`)."""
        verifier = Verifier(self.model, FakeLane(), self.config.run.prefill_chunk)
        here, _ = split_by_lane(draft_model=False, in_verify_lane=self.config.run.draft_in_verify_lane)
        sources = make_draft_sources(self.model, None, self.head, only=here)
        local = (
            DraftServer(sources, self.model.cfg.vocab_size, verifier.lane, self.model.tokenizer, counts=False)
            if here
            else None
        )
        return VerifyCore(verifier, verifier.lane, self.config, clock=lambda: self.now, local=local)

    def drafter_server(self, drafter: str) -> DraftServer:
        """The server that drafts `drafter`: the verify lane's own, or the draft lane's."""
        local = self.core.local
        return local if local is not None and drafter in local.sources else self.drafts

    def new_draft_server(self) -> DraftServer:
        """As the draft lane builds it: with the drafters the verify lane leaves to it, and the target's
        tokenizer, for requests with a response_format."""
        _, there = split_by_lane(draft_model=False, in_verify_lane=self.config.run.draft_in_verify_lane)
        sources = make_draft_sources(self.model, None, self.head, only=there)
        return DraftServer(sources, self.model.cfg.vocab_size, FakeLane(), self.model.tokenizer)

    def new_hub(self) -> Hub:
        tracing = RequestTracing(self.telemetry, PipelineMetrics(self.telemetry.meter, "tiny"), "tiny")
        assert self.model.tokenizer is not None
        tokenizer, context = self.model.tokenizer, self.model.cfg.context_length
        hub = Hub(self.config, tokenizer, context, tracing, LaneTable(), Journal(self.journal_path))
        tracing.metrics.observe(lambda: gauges_of(hub.status()))  # one thread here: no snapshot needed
        return hub

    def orchestrator_killed(self, deliver_in_flight: bool) -> None:
        """The orchestrator dies: its memory goes, the lanes may or may not get what it had sent,
        their replies are lost; a new one starts from the journal and the lanes beat to it."""
        self.orchestrator_dead = True
        if deliver_in_flight:
            self.run()
        self.in_flight.clear()
        self.hub.journal.close()
        self.orchestrator_dead = False
        self.hub = self.new_hub()
        self.feed(self.hub.recover(self.now))
        self.up(*self.beating)

    # --- the control lane ----------------------------------------------------------------

    def up(self, *lanes: str) -> None:
        for lane in lanes or ("verify", "draft", "audit", "orchestrator"):
            self.beating.add(lane)
            beat = Heartbeat(lane=lane, pid=self.pids[lane], state=SpeculativeState(), process=PROCESS)
            self.feed(self.hub.on_control(beat, self.now))

    def down(self, lane: str) -> None:
        """The lane's process dies: its state is gone, and the supervisor says so."""
        pid = self.pids[lane]
        self.pids[lane] += 1
        self.beating.discard(lane)
        if lane == "verify":
            self.core = self.new_core()
        if lane == "draft":
            self.drafts = self.new_draft_server()
        self.feed(self.hub.on_control(LaneDown(lane=lane, pid=pid, returncode=-9, restarts=1), self.now))

    def fail(self, lane: str, reason: str = "sqlite3.OperationalError: unable to open database file") -> None:
        """The lane's process dies once more than the restart intensity allows: no other comes."""
        self.beating.discard(lane)
        failed = LaneFailed(lane=lane, pid=self.pids[lane], returncode=1, restarts=5, reason=reason)
        self.feed(self.hub.on_control(failed, self.now))

    # --- moving messages --------------------------------------------------------------------

    def feed(self, sends: list[Send]) -> None:
        """The hub's sends on their way, audit events batched as the lane process batches them."""
        self.in_flight.extend(batched(sends))

    def reply(self, message: msgspec.Struct) -> None:
        """One message into the orchestrator's data inbox, taken at once (a burst of one)."""
        self.replies([message])

    def replies(self, messages: list[msgspec.Struct]) -> None:
        """Messages the orchestrator's data inbox holds at once: one burst, one journal transaction
        (several steps in one `Reported`, as the verify lane reports them)."""
        if self.orchestrator_dead or not messages:
            return
        if len(messages) > 1:
            messages = [Reported(messages=messages)]  # type: ignore[arg-type]
        self.feed(self.hub.on_burst([REPLIES.decode(encode(m)) for m in messages], self.now))

    def from_verify_lane(self, out: list[Out]) -> None:
        """The verify lane's sends: draft requests on their way to the draft lane, decided steps to
        the orchestrator (one at a time, or held for one burst with `burst_replies`)."""
        for item in out:
            if item.lane == "draft":
                self.feed([Send("draft", item.message)])
            elif self.burst_replies:
                self.reported.append(item.message)
            else:
                self.reply(item.message)

    def verify_lane_runs(self, out: list[Out]) -> None:
        """What the verify lane does after taking a message: forwards until nothing is queued. Its
        socket to the draft lane is connected while that lane runs."""
        self.from_verify_lane(out)
        self.core.draft_lane.connected = "draft" in self.beating
        while self.core.has_work():
            self.to_verifier.extend(self.core.queued)
            self.from_verify_lane(self.core.forward(self.after_forward))
        reported, self.reported = self.reported, []  # every forward's steps in one report
        self.replies(reported)

    def after_forward(self) -> float:
        """The verify lane's clock as a forward ends: `forward_seconds` after it began."""
        self.now += self.forward_seconds
        return self.now

    def deliver_one(self) -> Send:
        send = self.in_flight.popleft()
        self.sent.append(send)
        self.now += 0.001
        if send.lane in self.lost:
            return send
        data = send.message if isinstance(send.message, bytes) else encode(send.message)
        msg = CODECS[send.lane].decode(data)
        if send.lane == "verify":
            self.core.draft_lane.connected = "draft" in self.beating
            self.verify_lane_runs(self.core.receive(msg, self.now))
        elif send.lane == "draft":
            if type(msg).__name__ == "Close":
                self.drafts.close(msg)
            else:
                self.feed([Send("verify", self.drafts.draft(msg))])
        else:
            events = [EVENTS.decode(raw) for raw in msg.events] if isinstance(msg, AuditBatch) else [msg]
            self.audited.update((event.event_id, event) for event in events)
            ack = AuditAck(event_ids=[event.event_id for event in events])
            if not self.orchestrator_dead:  # on the control inbox, which a tick reads
                self.feed(self.hub.on_control(ack, self.now))
        return send

    def run(self, until: int | None = None) -> None:
        """Deliver messages (at most `until`) until none is in flight."""
        count = 0
        while self.in_flight and (until is None or count < until):
            self.deliver_one()
            count += 1

    def tick(self, seconds: float) -> None:
        """Time passes; every lane that is running and not frozen beats on the way."""
        self.now += seconds
        for lane in self.beating:
            beat = Heartbeat(lane=lane, pid=self.pids[lane], state=SpeculativeState(), process=PROCESS)
            self.feed(self.hub.on_control(beat, self.now))
        self.feed(self.hub.tick(self.now))
        self.verify_lane_runs(self.core.tick(self.now))

    # --- clients ----------------------------------------------------------------------------

    def submit(self, prompt: str = "ab ab ab ab", **fields: object) -> str:
        reply, sends = self.hub.submit(Submit(prompt=prompt, **fields), self.now)  # type: ignore[arg-type]
        assert isinstance(reply, Submitted), reply
        self.feed(sends)
        self.secrets[reply.request_id] = reply.secret
        return reply.request_id

    def result(self, request_id: str) -> Result | None:
        machine = self.hub.front.machine(request_id)
        return None if machine is None else machine.result

    def faults(self, kind: str | None = None) -> list[str]:
        return [f.lane for f in self.hub.ledger.faults if kind is None or f.kind == kind]
