"""The verify lane: the `VerifyCore` (pipeline/workers/verify_core.py) behind its sockets.

It drives every admitted request's decode loop: a forward as soon as steps are queued, with no
wait for the orchestrator. Before a forward it waits up to `run.batch_window_seconds` for proposals
still on their way from the draft lane, so those steps share it. Decided steps go to the
orchestrator, draft requests straight to the draft lane; neither send ever blocks the loop (a draft
the draft lane's socket cannot take now decodes plainly).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio

from lanes.lane import LaneContext, lane_main
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model import default_model_path, load_model
from pipeline.model.calibration import stored_row_seconds
from pipeline.protocol.messages import DraftRequest, VerifyInbox
from pipeline.protocol.transport import Inbox, Outbox
from pipeline.workers.driver import Out
from pipeline.workers.verifier import Verifier, runtime_report
from pipeline.workers.verify_core import VerifyCore

log = logging.getLogger(__name__)
DRAFT_BUFFER = 256  # draft requests the draft lane's socket holds while its pipe writes the ones before


async def serve(lane: LaneContext) -> None:
    config = lane.config
    path = Path(config.model.path or default_model_path())
    model = load_model(path, config.model.backend)
    lane.runtime = runtime_report(model)
    assert model.tokenizer is not None
    warm_up(model.tokenizer)  # every response_format request's grammar is compiled for it
    verifier = Verifier(model, lane, config.run.prefill_chunk, stored_row_seconds(model, path))
    core = VerifyCore(verifier, lane, config, wall_offset=time.time() - trio.current_time())
    inbox: Inbox = Inbox(config.bind("verify"), VerifyInbox, config.tls)
    results = lane.replies()
    drafts = Outbox(config.addresses.draft, config.tls, buffer=DRAFT_BUFFER)
    window = config.run.batch_window_seconds
    lane.heartbeat()  # tells the orchestrator we are ready

    reported: list[Out] = []  # decided steps not yet sent to the orchestrator
    last_report = [trio.current_time()]

    async def send(out: list[Out]) -> None:
        for item in out:
            if item.lane == "draft":
                if not drafts.put_nowait(item.message) and isinstance(item.message, DraftRequest):
                    await send(core.draft_unsent(item.message.request_id, trio.current_time()))
                continue
            reported.append(item)
        now = trio.current_time()
        if now - last_report[0] >= config.run.report_interval_seconds or not core.has_work():
            last_report[0] = now
            await report()

    async def report() -> None:
        out, reported[:] = list(reported), []
        for item in out:
            if results.put_nowait(item.message):
                continue
            try:  # the orchestrator is slow to take it: back-pressure, as run-ahead would give anyway
                await results.put(item.message, timeout=config.timeouts.send)
            except trio.TooSlowError:  # lost: the orchestrator re-primes the request from its journal
                lane.fault("timeout", "the orchestrator did not take a decided step", item.message.request_id)

    def receive(messages: list) -> list[Out]:
        out: list[Out] = []
        for msg in messages:
            out += core.receive(msg, trio.current_time())
        return out

    while True:
        core.draft_lane.connected = drafts.connected()
        if core.has_work():
            await trio.sleep(0)  # let the heartbeat run between forwards
            await send(receive(inbox.ready()))
        else:
            with trio.move_on_at(core.next_deadline()):
                await send(receive([await inbox.next(), *inbox.ready()]))
        deadline = trio.current_time() + window
        while core.awaiting_drafts() and trio.current_time() < deadline:
            with trio.move_on_at(min(deadline, core.next_deadline())):
                await send(receive([await inbox.next(), *inbox.ready()]))
        await send(core.tick(trio.current_time()))
        if core.has_work():
            await send(core.forward(trio.current_time()))
        verifier.expire()
        lane.state.active_requests = len(core.drivers)


def main() -> None:
    lane_main("verify", serve)


if __name__ == "__main__":
    main()
