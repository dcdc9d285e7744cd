"""The draft lane: the `DraftServer` (pipeline/workers/draft_server.py) behind its inbox.

It answers the verify lane, which drives each request's steps. A late draft is worthless, so
replies are never waited on: one the verify lane cannot take now is dropped and reported. It serves
the drafters the verify lane does not run itself (`registry.split_by_lane`): with
`run.draft_in_verify_lane` (the default) those that run a draft model, else every one, `learned`
included when there is a draft head for the target (`model.draft_head`, or the one found for the
model), whose features then come from the verify lane with each DraftRequest.
"""

from __future__ import annotations

import logging

from lanes.lane import LaneContext, lane_main
from pipeline.decoding.drafters.registry import split_by_lane
from pipeline.decoding.grammar.compiler import warm_up
from pipeline.model import load_model
from pipeline.model.default import model_path
from pipeline.model.store import load_front
from pipeline.protocol.messages import BadMessage, Close, DraftInbox
from pipeline.protocol.transport import Inbox
from pipeline.workers.draft_server import DraftServer, lane_sources

log = logging.getLogger(__name__)


async def serve(lane: LaneContext) -> None:
    config = lane.config
    served = model_path(config.model.path)
    target = load_front(served)  # vocabulary checks, the head's embedding rows: no other weights
    draft_path, backend, explicit = config.model.draft_path, config.model.backend, config.model.draft_head
    draft_model = load_model(draft_path, backend) if draft_path else None
    in_verify_lane = config.run.draft_in_verify_lane
    _, here = split_by_lane(draft_model=bool(draft_path), in_verify_lane=in_verify_lane)
    sources = lane_sources(here, target, draft_model, served, explicit)
    server = DraftServer(sources, target.cfg.vocab_size, lane, target.tokenizer)
    if target.tokenizer is not None:
        warm_up(target.tokenizer)  # a response_format request's drafter follows its grammar
    inbox: Inbox = Inbox(config.bind("draft"), DraftInbox, config.tls)
    results = lane.replies(config.addresses.verify)
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
            lane.fault("timeout", "the verify lane did not take a draft", msg.request_id, msg.step)


def main() -> None:
    lane_main("draft", serve)


if __name__ == "__main__":
    main()
