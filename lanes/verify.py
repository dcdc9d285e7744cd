"""The verify lane: the `VerifyCore` (pipeline/workers/verify_core.py) behind its sockets.

It drives every admitted request's decode loop: a forward as soon as steps are queued, with no
wait for the orchestrator. The drafters that run no draft model draft here, between forwards
(`local_drafts`); before a forward it waits up to `run.batch_window_seconds` for proposals still on
their way from the draft lane, so those steps share it. Decided steps go to the orchestrator, draft
requests for the draft lane straight to it; neither send ever blocks the loop (a draft the draft
lane's socket cannot take now decodes plainly).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio

from lanes.lane import LaneContext, lane_main
from pipeline.decoding.drafters.registry import split_by_lane
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model import Runtime, load_model
from pipeline.model.calibration import stored_row_seconds
from pipeline.model.default import model_path
from pipeline.protocol.messages import DraftRequest, Reported, VerifyInbox
from pipeline.protocol.transport import Inbox, Outbox
from pipeline.workers.draft_server import DraftServer, lane_sources
from pipeline.workers.driver import Out
from pipeline.workers.loop_phases import LoopPhase, Stopwatch
from pipeline.workers.verifier import Verifier, runtime_report
from pipeline.workers.verify_core import VerifyCore, reports_now

log = logging.getLogger(__name__)
DRAFT_BUFFER = 256  # draft requests the draft lane's socket holds while its pipe writes the ones before
# Between forwards the event loop gets a turn (the heartbeat, timers, a read of the inbox whatever its
# descriptor says) at least this often; in between, the inbox is read only when its descriptor says a
# message waits. A turn and a read cost 0.1-0.2 ms between two forwards, where the interpreter's caches
# come back cold (docs/benchmarks.md#where-the-per-step-cost-goes), against a poll's few microseconds.
TURN_SECONDS = 0.025


class VerifyLane:
    """The sockets around the core: the inbox, the draft lane's socket and the orchestrator's."""

    def __init__(self, lane: LaneContext, core: VerifyCore, watch: Stopwatch) -> None:
        config = lane.config
        self.lane, self.core, self.config, self.watch = lane, core, config, watch
        self.inbox: Inbox = Inbox(config.bind("verify"), VerifyInbox, config.tls)
        self.results = lane.replies()
        self.drafts = Outbox(config.addresses.draft, config.tls, buffer=DRAFT_BUFFER)
        self.reported: list[Out] = []  # decided steps not yet sent to the orchestrator
        self.urgent = False  # among them a first token, a last step or a failure (`reports_now`)
        self.last_report = self.next_turn = trio.current_time()

    async def send(self, out: list[Out]) -> None:
        """Draft requests at once; decided steps every `run.report_interval_seconds` while the lane
        keeps decoding, and all of them as soon as it has nothing queued or one of them is a first
        token, a last step or a failure (`reports_now`)."""
        with self.watch.phase(LoopPhase.REPORT):
            await self._send(out)

    async def _send(self, out: list[Out]) -> None:
        self.urgent = self.urgent or reports_now(out)
        for item in out:
            if item.lane != "draft":
                self.reported.append(item)
            elif not self.drafts.put_nowait(item.message) and isinstance(item.message, DraftRequest):
                await self.send(self.core.draft_unsent(item.message.request_id, trio.current_time()))
        now = trio.current_time()
        run = self.config.run
        if self.urgent or now - self.last_report >= run.report_interval_seconds or not self.core.has_work():
            self.last_report, self.urgent = now, False
            reported = bool(self.reported)
            await self.report()
            if reported and run.report_pause_seconds > 0 and self.core.has_work():
                with self.watch.phase(LoopPhase.PAUSE):  # their readers run now, not inside a forward
                    await trio.sleep(run.report_pause_seconds)

    async def report(self) -> None:
        """Everything decided since the last report, as one message (one a step cost the orchestrator
        a wake-up each)."""
        out, self.reported = self.reported, []
        if not out:
            return
        messages = [item.message for item in out]
        report = messages[0] if len(messages) == 1 else Reported(messages=messages)  # type: ignore[arg-type]
        if self.results.put_nowait(report):
            return
        try:  # the orchestrator is slow to take it: back-pressure, as run-ahead would give anyway
            await self.results.put(report, timeout=self.config.timeouts.send)
        except trio.TooSlowError:  # lost: the orchestrator re-primes the requests from its journal
            for request_id in dict.fromkeys(m.request_id for m in messages):
                self.lane.fault("timeout", "the orchestrator did not take a decided step", request_id)

    async def receive(self, messages: list) -> None:
        out: list[Out] = []
        for msg in messages:
            out += self.core.receive(msg, trio.current_time())
        await self.send(out)

    async def run(self) -> None:
        core, inbox, window = self.core, self.inbox, self.config.run.batch_window_seconds
        phase = self.watch.phase
        while True:
            core.draft_lane.connected = self.drafts.connected()
            if core.has_work():
                with phase(LoopPhase.CHECKPOINT):
                    if trio.current_time() >= self.next_turn:
                        await trio.sleep(0)  # let the heartbeat run between forwards
                        self.next_turn = trio.current_time() + TURN_SECONDS
                        await self.receive(inbox.ready())
                    elif inbox.waiting():
                        await self.receive(inbox.ready())
            else:
                with phase(LoopPhase.HELD if core.drivers else None), trio.move_on_at(core.next_deadline()):
                    await self.receive([await inbox.next(), *inbox.ready()])
            deadline = trio.current_time() + window
            with phase(LoopPhase.DRAFT_WAIT if core.awaiting_drafts() else None):
                while core.awaiting_drafts() and trio.current_time() < deadline:
                    with trio.move_on_at(min(deadline, core.next_deadline())):
                        await self.receive([await inbox.next(), *inbox.ready()])
            await self.send(core.tick(trio.current_time()))
            if core.has_work():
                with phase(LoopPhase.BOOKKEEPING):
                    out = core.forward(trio.current_time)
                await self.send(out)
            core.expire()
            self.lane.state.active_requests = len(core.drivers)


async def serve(lane: LaneContext) -> None:
    config = lane.config
    path = model_path(config.model.path)
    model = load_model(path, config.model.backend)
    lane.runtime = runtime_report(model)
    assert model.tokenizer is not None
    warm_up(model.tokenizer)  # every response_format request's grammar is compiled for it
    watch = Stopwatch(lane.state.loop_seconds)
    verifier = Verifier(model, lane, config.run.prefill_chunk, stored_row_seconds(model, path), watch)
    local = local_drafts(lane, model, path)
    offset = time.time() - trio.current_time()
    core = VerifyCore(verifier, lane, config, clock=trio.current_time, wall_offset=offset, local=local)
    sockets = VerifyLane(lane, core, watch)
    lane.heartbeat()  # tells the orchestrator we are ready
    await sockets.run()


def local_drafts(lane: LaneContext, model: Runtime, path: Path) -> DraftServer | None:
    """The drafters this lane runs itself (`run.draft_in_verify_lane`), beside the target."""
    config = lane.config
    here, _ = split_by_lane(
        draft_model=bool(config.model.draft_path), in_verify_lane=config.run.draft_in_verify_lane
    )
    if not here:
        return None
    sources = lane_sources(here, model, None, path, config.model.draft_head)
    return DraftServer(sources, model.cfg.vocab_size, lane, model.tokenizer, counts=False)


def main() -> None:
    lane_main("verify", serve)


if __name__ == "__main__":
    main()
