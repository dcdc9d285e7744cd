"""The orchestrator lane: sockets and timers around the I/O-free `Hub` (pipeline/orchestration).

Everything it receives (decided steps on the data inbox; lane news, faults and audit
acknowledgements on the control inbox, which each tick drains; client calls on the Rep socket; the
clock) goes into the hub; every `Send` that comes back goes out on the lane's Push socket. Sends to
the verify lane keep their order and never block the loop; audit events are held for
`audit.batch_seconds` and go as one AuditBatch, and one that cannot be handed over now is given back
to the hub (its events are re-sent later). The verify lane drives the decode loops: this process
journals, streams and audits the steps it decides, and tells it how far the journal has got. A
Submit's prompt is tokenized in a worker thread (`Hub.admit`), so a long prompt delays only its own
request, never the loop; so are `Tokenize` and `Detokenize`. Clients read their chunks through
`ClientStreams` (lanes/client_streams.py): long polls, or pushes to the gateway. A
`MetricsQuery` is answered with the Prometheus text of this process's instruments
(observability/prometheus.py). The state-like ones (requests decoding and queued, lanes)
read `gauges`, a snapshot the loop takes every tick and before each MetricsQuery: the OTLP exporter
collects from its own thread, which must not walk the hub's structures while the loop changes them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Any

import msgspec
import pynng
import trio

from lanes.client_streams import ClientStreams
from lanes.lane import LaneContext, lane_main
from lanes.ticker import Ticker
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model.default import model_path
from pipeline.model.draft_head import head_file
from pipeline.model.store import load_front
from pipeline.observability.metrics import PipelineMetrics
from pipeline.observability.prometheus import CONTENT_TYPE, PrometheusExposition
from pipeline.orchestration.effects import Send, batched
from pipeline.orchestration.hub import Hub
from pipeline.orchestration.journal import open_journal
from pipeline.orchestration.lane_table import LANES, LaneTable
from pipeline.orchestration.storage import StorageFull, StorageGuard
from pipeline.orchestration.tokenizing import detokenize, tokenize
from pipeline.orchestration.tracing import RequestTracing, gauges_of
from pipeline.protocol.config import PREDECESSOR
from pipeline.protocol.messages import (
    BadMessage,
    Cancel,
    ClientRequest,
    Codec,
    ControlInbox,
    DataInbox,
    Detokenize,
    ErrorReply,
    Heartbeat,
    LaneDown,
    Message,
    MetricsQuery,
    MetricsReport,
    Poll,
    StatusQuery,
    Submit,
    Tokenize,
    Watch,
    encode,
)  # fmt: skip
from pipeline.protocol.transport import Inbox, Outbox, listen

log = logging.getLogger(__name__)
# The tick (`Hub.tick`): at least this often, and with any wake-up at least RIDE_AFTER past the last one
# (lanes/ticker.py); while steps flow, that is with each burst, every 50-60 ms.
TICK_SECONDS = 0.1
RIDE_AFTER_SECONDS = 0.04
# Messages a lane's socket holds while its pipe writes the ones before: the verify lane decides steps in
# bursts (several requests per forward, run-ahead caught up), and each is an audit event to send at once.
SEND_BUFFER = 256
ADMITTING_THREADS = 2  # prompts tokenized at once; more Submits wait their turn (memory stays bounded)


class OrchestratorLane:
    def __init__(self, hub: Hub, lane: LaneContext, exposition: PrometheusExposition) -> None:
        config = lane.config
        self.hub, self.config, self.exposition = hub, config, exposition
        self.gauges = gauges_of(hub.status())  # replaced whole, so a reader in another thread sees one
        self.outboxes = {
            name: Outbox(getattr(config.addresses, name), config.tls, buffer=SEND_BUFFER)
            for name in ("verify", "audit")
        }
        # The gateway's inbox only where a gateway runs: a dialer to no one retries forever.
        gateway = "gateway" in config.processes()
        pushes = Outbox(config.addresses.gateway, config.tls, buffer=SEND_BUFFER) if gateway else None
        limits = (config.timeouts.poll_wait_max, config.admission.max_message_bytes)
        self.streams = ClientStreams(hub.front, pushes, *limits)
        self.verify_queue, self.verify_backlog = trio.open_memory_channel[Send](math.inf)
        self.audit_held: list[Send] = []  # audit events until a tick sends them together (`send_audit`)
        self.audit_sent = -math.inf  # when they last went
        self.queued_for_verify = 0
        self.codec: Codec[Any] = Codec(ClientRequest)
        self.admitting = trio.CapacityLimiter(ADMITTING_THREADS)
        self.storage = StorageGuard(Path(config.run.journal).parent, config.storage.min_free_bytes)
        self.ticker = Ticker(TICK_SECONDS, RIDE_AFTER_SECONDS, self.tick)
        self.control: Inbox | None = None  # the control inbox, once `run` listens on it

    def now(self) -> float:
        return trio.current_time()

    def dispatch(self, sends: list[Send]) -> None:
        for send in sends:
            if send.lane == "audit":
                self.audit_held.append(send)  # sent by a tick (`send_audit`)
                continue
            if send.lane == "verify":
                if self.queued_for_verify or not self.outboxes["verify"].put_nowait(send.message):  # type: ignore[arg-type]
                    self.queued_for_verify += 1
                    self.verify_queue.send_nowait(send)
                continue
        self.streams.news(self.hub.changed)
        self.hub.changed.clear()

    def send_audit(self) -> None:
        """The audit events held since they last went, as few AuditBatch messages (a tick sends them
        once `audit.batch_seconds` has passed). Why held: a message wakes the audit lane (and its
        commit, span and acknowledgement, which wakes this loop again) on the forward's cores; one a
        burst of steps woke it for every one or two tokens. They are in the journal's outbox meanwhile,
        so a crash loses none. One the socket cannot take now is given back to the hub, which sends its
        events again."""
        self.audit_sent = self.now()
        held, self.audit_held = batched(self.audit_held), []
        for send in held:
            data = send.message if isinstance(send.message, bytes) else encode(send.message)
            if not self.outboxes[send.lane].put_bytes_nowait(data):
                self.dispatch(self.hub.send_failed(send, self.now()))

    async def send_to_verify(self) -> None:
        """In order. A lane that takes nothing for `timeouts.send` is logged and the message
        dropped: the request machine's own deadline sends the step again."""
        async for send in self.verify_backlog:
            try:
                await self.outboxes["verify"].put(send.message, timeout=self.config.timeouts.send)  # type: ignore[arg-type]
            except trio.TooSlowError:
                log.warning("the verify lane took nothing for %.1f s", self.config.timeouts.send)
            self.queued_for_verify -= 1

    def guarded(self, handle: Any, *args: Any) -> None:
        """A bug in handling one message costs that message (logged), never the orchestrator."""
        try:
            sends = handle(*args, self.now())
        except Exception:
            log.exception("orchestrator core failed on %s", type(args[0]).__name__ if args else "tick")
            return
        self.dispatch(sends)

    def reachable(self, msg: object) -> bool:
        """A lane's heartbeat counts only once our socket to it is connected: "up" must mean that a
        message sent now arrives (a lane that just started listens before our dialer reconnects)."""
        if isinstance(msg, Heartbeat) and msg.lane in self.outboxes:
            return self.outboxes[msg.lane].connected()
        return True

    async def receive_data(self, inbox: Inbox) -> None:
        """Decided steps in bursts: everything the inbox holds at once is journaled in one
        transaction (`Hub.on_burst`); then one StepsJournaled tells the verify lane how far the
        journal has got and the polls waiting on it wake (its audit events go with the next tick,
        which runs in this wake-up when it is nearly due: `Ticker.ride`)."""
        while True:
            self.guarded(self.hub.on_burst, [await inbox.next(), *inbox.ready()])
            self.ticker.ride(self.now())

    def read_control(self) -> None:
        """The control inbox, drained at each tick rather than waited on: its heartbeats (a lane's
        every `run.heartbeat_seconds`), faults, lane news and audit acknowledgements woke this loop
        about 20 times a second while a stream ran, and none needs an answer sooner than a tick
        (at most `TICK_SECONDS`). nng keeps what arrives meanwhile."""
        for msg in self.control.ready() if self.control is not None else ():
            if self.reachable(msg):
                self.guarded(self.hub.on_control, msg)

    def tick(self) -> None:
        self.read_control()
        self.guarded(self.hub.tick)
        if self.now() >= self.audit_sent + self.config.audit.batch_seconds:
            self.send_audit()
        if failure := self.hub.journal.take_failure():
            self.storage.failed(failure)
        self.storage.check(self.now(), self.hub.journal.probe)
        self.gauges = gauges_of(self.hub.status())

    async def answer(self, data: bytes) -> Message:
        try:
            msg = self.codec.decode(data)
        except BadMessage as exc:
            return ErrorReply(kind="bad_request", message=str(exc))
        if isinstance(msg, Submit):
            return await self.submit(msg)
        if isinstance(msg, Cancel):
            reply, sends = self.hub.cancel(msg.request_id, msg.secret, self.now())
        elif isinstance(msg, Poll):
            return await self.streams.poll(msg)
        elif isinstance(msg, Watch):
            return await self.streams.watch(msg)
        elif isinstance(msg, Tokenize | Detokenize):
            return await self.tokenizer_call(msg)
        elif isinstance(msg, MetricsQuery):
            self.gauges = gauges_of(self.hub.status())  # exactly what `status` says now
            self.hub.tracing.metrics.flush()  # and every step decided so far
            return MetricsReport(text=self.exposition.text(), content_type=CONTENT_TYPE)
        else:
            assert isinstance(msg, StatusQuery)
            return msgspec.structs.replace(self.hub.status(), storage=self.storage.reason)
        self.dispatch(sends)
        return reply

    async def tokenizer_call(self, msg: Tokenize | Detokenize) -> Message:
        """Off the event loop and under the same limit as a Submit's tokenizing (the text may be long)."""
        hub = self.hub
        if isinstance(msg, Detokenize):
            return await trio.to_thread.run_sync(detokenize, msg, hub.tokenizer, limiter=self.admitting)
        call = (tokenize, msg, hub.tokenizer, hub.context_length)
        return await trio.to_thread.run_sync(*call, limiter=self.admitting)

    async def submit(self, msg: Submit) -> Message:
        """Tokenized off the event loop, then opened in it (the hub is not thread-safe). A full disk
        refuses it (storage.py), before or while it is journaled."""
        if (early := self.hub.early_answer(msg) or self.storage.refusal()) is not None:
            return early
        # Each Submit waiting for a tokenizer thread holds its whole prompt: bound them as well, by as
        # many as could be admitted at all.
        waiting, limits = self.admitting.statistics().tasks_waiting, self.config.admission
        if waiting >= limits.max_running + limits.max_queued:
            message = f"{waiting} prompts are waiting to be tokenized; try again shortly"
            return ErrorReply(kind="overloaded", message=message)
        admitted = await trio.to_thread.run_sync(self.hub.admit, msg, limiter=self.admitting)
        if isinstance(admitted, ErrorReply):
            return admitted
        try:
            reply, sends = self.hub.open(msg, admitted, self.now())
        except StorageFull as exc:
            self.storage.failed(exc)
            return ErrorReply(kind="storage_full", message=self.storage.reason)
        self.dispatch(sends)
        return reply

    async def serve_client(self, nursery: trio.Nursery, sock: pynng.Socket, idle: list[int]) -> None:
        """One Rep context; starts another when it is the last idle one, so long polls never
        starve new clients."""
        ctx = sock.new_context()
        try:
            while True:
                idle[0] += 1
                data = await ctx.arecv()
                idle[0] -= 1
                if idle[0] == 0:
                    nursery.start_soon(self.serve_client, nursery, sock, idle)
                try:
                    reply = await self.answer(data)
                except Exception as exc:  # a bug must cost one reply, not the service
                    log.exception("client request failed")
                    reply = ErrorReply(kind="internal", message=repr(exc))
                await ctx.asend(encode(reply))
                self.ticker.ride(self.now())
        finally:
            ctx.close()

    async def run(self) -> None:
        config, hub = self.config, self.hub
        data = Inbox(config.bind("data"), DataInbox, config.tls)
        self.control = Inbox(config.bind("control"), ControlInbox, config.tls)
        clients = listen(pynng.Rep0, config.bind("client"), config.tls, config.admission.max_message_bytes)
        # What a previous orchestrator left in the journal, and how it died (the supervisor says).
        predecessor = os.environ.get(PREDECESSOR)
        death = msgspec.json.decode(predecessor, type=LaneDown) if predecessor else None
        self.dispatch(hub.recover(self.now(), death))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.receive_data, data)
                nursery.start_soon(self.send_to_verify)
                nursery.start_soon(self.ticker.run)
                nursery.start_soon(self.serve_client, nursery, clients, [0])
        finally:  # on the way out, what the last tick did not send (best effort: the journal keeps it)
            self.send_audit()
            self.hub.tracing.metrics.flush()  # exported as the process ends (lane_main)


async def serve(lane: LaneContext, exposition: PrometheusExposition) -> None:
    # model.path made explicit (the default model's file when empty): every request's audit record
    # then names the file it was served from, which `audit verify` re-runs. model.draft_head too: the
    # head the draft lane serves `learned` with, or "" when it has none (admission refuses `learned`).
    path, model = str(model_path(lane.config.model.path)), lane.config.model
    cfg, embed, tokenizer = load_front(Path(path))  # the embedding is read only to check a head
    head = head_file(Path(path), cfg, embed, model.draft_head)
    model = msgspec.structs.replace(model, path=path, draft_head=str(head) if head else "")
    config = msgspec.structs.replace(lane.config, model=model)
    warm_up(tokenizer)  # admission compiles every response_format once (a bad schema is a 400)
    names = (*LANES, "gateway") if "gateway" in config.processes() else LANES  # readiness waits for it too
    metrics = PipelineMetrics(lane.telemetry.meter, config.model_id())
    tracing = RequestTracing(lane.telemetry, metrics, config.model_id())
    journal = open_journal(config.run.journal)  # a damaged one is set aside, with a warning
    hub = Hub(config, tokenizer, cfg.context_length, tracing, LaneTable(names), journal)
    orchestrator = OrchestratorLane(hub, lane, exposition)
    metrics.observe(lambda: orchestrator.gauges)
    await orchestrator.run()


def main() -> None:
    exposition = PrometheusExposition()  # its reader joins this process's meter provider
    lane_main("orchestrator", functools.partial(serve, exposition=exposition), [exposition.reader])


if __name__ == "__main__":
    main()
