"""The draft lane: every drafter, one per active request, plus the cross-request cache.

A draft request carries the whole accepted context and what is needed to rebuild the
request's drafter, so a restarted lane answers the next step with no handshake. Drafts
only change speed, never output: a drafter that raises is reported and answered with
an empty proposal. A draft request may carry the target's features (for a learned drafter):
the drafter observes them before it proposes, once per step (a repeat is answered from the
cache); a restarted lane's drafter starts its history where the first ones it gets begin.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from pipeline.decoding.adaptive import K_LIMIT
from pipeline.decoding.controls import vocabulary_problem
from pipeline.decoding.drafters import EMPTY, Drafter, DraftSource, observe
from pipeline.decoding.drafters.kinds import needs_head
from pipeline.decoding.drafters.registry import make_draft_sources
from pipeline.decoding.grammar.drafting import following
from pipeline.model import Runtime
from pipeline.model.draft_head import servable_head
from pipeline.model.store import Front
from pipeline.model.tokenizer import Tokenizer
from pipeline.protocol.messages import Close, Drafted, DraftRequest, Rows, StepFailed
from pipeline.workers.reporting import LaneReporter, step_failed
from pipeline.workers.step_spans import DRAFT_COLUMNS, RunSpans

log = logging.getLogger(__name__)

MAX_REQUESTS = 1024  # drafters kept at once; the least recently used go first


class ActiveDraft:
    def __init__(self, drafter: Drafter, prompt_length: int) -> None:
        self.drafter, self.seen = drafter, prompt_length + 1  # the first step's context: prompt + 1 token
        self.reply: Drafted | None = None


class DraftServer:
    """`tokenizer`: the target's, for requests with a response_format (their drafters put the grammar's
    forced tokens first); without it such requests get the drafters' proposals alone. The draft lane
    runs one, and so does the verify lane for the drafters it runs itself (`registry.split_by_lane`)."""

    def __init__(
        self, sources: dict[str, DraftSource], vocab_size: int, lane: LaneReporter,
        tokenizer: Tokenizer | None = None, counts: bool = True,
    ) -> None:  # fmt: skip
        """`counts`: add the drafts to the lane's `drafted` (a server inside the verify lane does not:
        that lane counts the drafts it verifies)."""
        self.sources, self.vocab_size, self.lane, self.tokenizer = sources, vocab_size, lane, tokenizer
        self.counts = counts
        self.active: OrderedDict[str, ActiveDraft] = OrderedDict()
        self.spans = RunSpans(lane.telemetry, "draft", DRAFT_COLUMNS)  # a span per run of drafts

    def problem(self, msg: DraftRequest) -> str | None:
        if msg.drafter not in self.sources:
            return f"drafter {msg.drafter!r} is not served here (have: {', '.join(self.sources)})"
        if not 0 <= msg.k <= K_LIMIT:
            return f"k must be 0..{K_LIMIT}, got {msg.k}"
        if not 0 < msg.prompt_length <= len(msg.context):
            return f"prompt length {msg.prompt_length} for a context of {len(msg.context)}"
        if any(not 0 <= t < self.vocab_size for t in msg.context):
            return f"token id out of range [0, {self.vocab_size})"
        if msg.features is not None and (problem := features_problem(msg)) is not None:
            return problem
        return vocabulary_problem(msg.params, self.vocab_size)

    def draft(self, msg: DraftRequest) -> Drafted | StepFailed:
        if (problem := self.problem(msg)) is not None:
            return step_failed(self.lane, msg, "bad_request", problem)
        active = self.active.get(msg.request_id)
        if active is not None and active.reply is not None and active.reply.step == msg.step:
            return active.reply
        start_ns = time.time_ns()
        reply = self.propose(msg, active)
        values: dict[str, int | str] = {"k": msg.k}
        if isinstance(reply, Drafted):
            values |= {"drafted": len(reply.tokens), "drafter": reply.drafter}
        else:
            values["failed"] = reply.kind
        drafted = len(reply.tokens) if isinstance(reply, Drafted) else 0
        self.spans.record(msg.request_id, msg.trace, msg.step, values, {"drafted": drafted}, start_ns)
        if msg.request_id not in self.active:  # its drafter failed: the run ends with it
            self.spans.end(msg.request_id)
        return reply

    def start(self, msg: DraftRequest, prompt: list[int]) -> Drafter:
        """The request's drafter: with a response_format, behind the grammar's forced tokens."""
        drafter = self.sources[msg.drafter].start(prompt, msg.params, msg.seed)
        if self.tokenizer is None:
            return drafter
        fmt = msg.params.response_format
        return following(drafter, fmt, self.tokenizer, self.vocab_size, msg.prompt_length)

    def propose(self, msg: DraftRequest, active: ActiveDraft | None) -> Drafted | StepFailed:
        start = time.perf_counter()
        try:
            if active is None:
                prompt = msg.context[: msg.prompt_length]
                active = ActiveDraft(self.start(msg, prompt), msg.prompt_length)
                self.active[msg.request_id] = active
                while len(self.active) > MAX_REQUESTS:
                    self.spans.end(self.active.popitem(last=False)[0])
            self.active.move_to_end(msg.request_id)
            if msg.features is not None:  # the kept positions' features, before the context they explain
                observe(active.drafter, msg.features_at, msg.features.array())
            if len(msg.context) != active.seen:
                active.drafter.accept(msg.context)
                active.seen = len(msg.context)
            proposal = active.drafter.propose(msg.context, msg.k, msg.tree, msg.floor) if msg.k else None
        except Exception as exc:
            self.active.pop(msg.request_id, None)
            return step_failed(self.lane, msg, "draft_failed", f"{msg.drafter} drafter raised {exc!r}")
        proposal = proposal or EMPTY
        tokens = proposal.tokens[: msg.k]
        probs = None if proposal.probs is None else proposal.probs[: len(tokens)]
        # A tree's first k nodes are a tree too: parents come before their children.
        parents = None if proposal.parents is None else proposal.parents[: msg.k]
        shares = None if proposal.shares is None else proposal.shares[: msg.k]
        active.reply = Drafted(
            request_id=msg.request_id, step=msg.step, trace=msg.trace, tokens=tokens,
            probs=None if probs is None else Rows.of(np.asarray(probs)),
            drafter=proposal.drafter or msg.drafter, seconds=time.perf_counter() - start,
            parents=parents, shares=shares,
        )  # fmt: skip
        if self.counts:
            self.lane.state.drafted += len(tokens)
        return active.reply

    def close(self, msg: Close) -> None:
        active = self.active.pop(msg.request_id, None)
        self.spans.end(msg.request_id)
        if active is not None and msg.context:
            try:
                active.drafter.finish(msg.context)
            except Exception as exc:
                self.lane.fault("draft_failed", f"finish raised {exc!r}", msg.request_id)
            self.lane.state.runs += 1
        self.lane.state.active_requests = len(self.active)


def features_problem(msg: DraftRequest) -> str | None:
    """Why a request's features cannot be the target's at positions [features_at, ...): each lies
    before the pending token (the newest, which no forward has read yet), in rows that fit their shape."""
    assert msg.features is not None
    n, width = msg.features.shape
    if width <= 0 or msg.features.problem() is not None:
        return f"features of shape {msg.features.shape} in {len(msg.features.data)} bytes"
    at, length = msg.features_at, len(msg.context)
    if at < 0 or at + n >= length:
        return f"features for positions {at}..{at + n - 1} of a context of {length}"
    return None


def lane_sources(
    names: list[str], target: Runtime | Front, draft_model: Runtime | None, served: Path, explicit_head: str
) -> dict[str, DraftSource]:
    """The sources a lane serves for `names` (`registry.split_by_lane`), with the draft head built only
    when one of them drafts with it (`draft_head.servable_head`)."""
    wants_head = any(map(needs_head, names))
    head = servable_head(served, target.cfg, target.embed, explicit_head) if wants_head else None
    return make_draft_sources(target, draft_model, head, only=names)
