"""The verify lane: the `Verifier` (pipeline/workers/verifier.py) behind its inbox.

Waits a moment (run.batch_window_seconds) for the other active requests' steps so they share
one forward; runs another forward at once while prompts are still being prefilled.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from lanes.lane import LaneContext, lane_main
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model import default_model_path, load_model
from pipeline.model.calibration import stored_row_seconds
from pipeline.protocol.messages import VerifyInbox
from pipeline.protocol.transport import Inbox
from pipeline.workers.verifier import Verifier, runtime_report

log = logging.getLogger(__name__)


async def serve(lane: LaneContext) -> None:
    config = lane.config
    path = Path(config.model.path or default_model_path())
    model = load_model(path, config.model.backend)
    lane.runtime = runtime_report(model)
    assert model.tokenizer is not None
    warm_up(model.tokenizer)  # every response_format request's grammar is compiled for it
    verifier = Verifier(model, lane, config.run.prefill_chunk, stored_row_seconds(model, path))
    inbox: Inbox = Inbox(config.bind("verify"), VerifyInbox, config.tls)
    results = lane.replies()
    window = config.run.batch_window_seconds
    lane.heartbeat()  # tells the orchestrator we are ready
    while True:
        if verifier.busy():
            await trio.sleep(0)  # let the inbox and the heartbeat run between chunks
            messages = list(inbox.ready())
        else:
            messages = [await inbox.next(), *inbox.ready()]
        deadline = trio.current_time() + window
        while verifier.waiting_for_more(messages) and trio.current_time() < deadline:
            with trio.move_on_at(deadline):
                messages.append(await inbox.next())
            messages.extend(inbox.ready())
        try:
            replies = verifier.handle(messages)
        except Exception as exc:  # a bug costs these requests a re-prime, never the lane
            log.exception("verify step failed")
            lane.fault("verification_failed", f"unexpected {exc!r}; the requests involved will be re-primed")
            for msg in messages:
                verifier.requests.pop(getattr(msg, "request_id", ""), None)
            replies = []
        for reply in replies:
            try:
                await results.put(reply, timeout=config.timeouts.send)
            except trio.TooSlowError:
                lane.fault("timeout", "the orchestrator did not take a verify result", reply.request_id)
        verifier.expire()


def main() -> None:
    lane_main("verify", serve)


if __name__ == "__main__":
    main()
