"""The draft lane: the `DraftServer` (pipeline/workers/draft_server.py) behind its inbox.

A late draft is worthless, so replies are never waited on: one the orchestrator cannot take
now is dropped and reported.
"""

from __future__ import annotations

import logging

from lanes.lane import LaneContext, lane_main
from pipeline.decoding.drafters.registry import make_draft_sources
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model import default_model_path, load_model
from pipeline.model.store import load_front
from pipeline.protocol.messages import BadMessage, Close, DraftInbox
from pipeline.protocol.transport import Inbox
from pipeline.workers.draft_server import DraftServer

log = logging.getLogger(__name__)


async def serve(lane: LaneContext) -> None:
    config = lane.config
    target = load_front(config.model.path or default_model_path())  # vocabulary checks only: no weights
    draft_path, backend = config.model.draft_path, config.model.backend
    draft_model = load_model(draft_path, backend) if draft_path else None
    sources = make_draft_sources(target, draft_model)
    server = DraftServer(sources, target.cfg.vocab_size, lane, target.tokenizer)
    if target.tokenizer is not None:
        warm_up(target.tokenizer)  # a response_format request's drafter follows its grammar
    inbox: Inbox = Inbox(config.bind("draft"), DraftInbox, config.tls)
    results = lane.replies()
    lane.heartbeat()
    async for msg in inbox:
        if isinstance(msg, BadMessage):
            lane.fault("bad_request", str(msg))
            continue
        try:
            if isinstance(msg, Close):
                server.close(msg)
                continue
            reply = server.draft(msg)
        except Exception as exc:  # a bug costs one draft (the step decodes plainly), never the lane
            log.exception("draft lane failed on %s", type(msg).__name__)
            lane.fault("draft_failed", f"unexpected {exc!r}", msg.request_id)
            server.active.pop(msg.request_id, None)
            continue
        lane.state.active_requests = len(server.active)
        if not results.put_nowait(reply):  # late drafts are worthless: never wait to send one
            lane.fault("timeout", "the orchestrator did not take a draft", msg.request_id, msg.step)


def main() -> None:
    lane_main("draft", serve)


if __name__ == "__main__":
    main()
