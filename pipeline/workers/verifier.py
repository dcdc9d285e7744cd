"""The verify lane: the target model, one KV cache per active request, the acceptance rule.

Requests waiting at the same time are verified in one batched forward: the weights are
read once for all their rows, attention stays per request. Each (request, step) is
executed once; a repeat is answered from the reply cache.

Prompts are prefilled in chunks of `run.prefill_chunk` rows that ride in the same forwards
as the other requests' verify steps, so a long prompt delays each neighbour's step by one
chunk at a time instead of by its whole prefill (with no neighbour decoding, it is fed whole:
`prefill_budget`). The runtime's row invariance makes this free of consequences for the
numbers: a position's logits are the same in a chunk, in a whole-prompt prefill or in a
decode step. For the same reason a prompt that begins like tokens a cache here already holds
copies their K/V instead of computing them again (`prefix_reuse`: the n choices of one OpenAI
request, a shared system prompt).

For a request whose drafter reads the target's features (`Open.features`: a learned drafter), the
forwards also compute each row's feature, and the Opened and each Verified carry those of the
positions kept (`Rows`): the prompt positions this lane computed (copied ones have none: the
drafter's history then starts after them), the pending token's and the accepted drafts'. Row
invariance makes them the bits an in-process run hands its drafter.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.decoding.controls import vocabulary_problem
from pipeline.decoding.drafters import Proposal
from pipeline.decoding.target import TargetState
from pipeline.decoding.tree import check, rows_parents
from pipeline.model import Runtime, backend_key
from pipeline.model.calibration import row_seconds
from pipeline.model.cpu import cpu_name, kernel_flags
from pipeline.model.llama import KVCache
from pipeline.protocol.messages import BadMessage, Close, Open, Opened, Rows, StepFailed, Verified, Verify
from pipeline.workers.grammar import opened_target
from pipeline.workers.loop_phases import LoopPhase, Stopwatch
from pipeline.workers.prefix_reuse import Holder, PrefixReuse
from pipeline.workers.reporting import LaneReporter, step_failed
from pipeline.workers.step_spans import StepSpans

log = logging.getLogger(__name__)

IDLE_SECONDS = 600.0  # a request not heard of for this long is dropped (its Close was lost)


@dataclass
class Prefill:
    """A prompt being fed chunk by chunk; its Opened reply goes out when the last chunk is in."""

    msg: Open
    target: TargetState
    started_ns: int
    fed: int = 0  # prompt positions in the cache (computed here or copied)
    reused: int = 0  # of them, copied from another cache (`prefix_reuse`)
    # With `msg.features`: the features of the last run of positions computed here, from features_at.
    features: list[np.ndarray] = field(default_factory=list)
    features_at: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.msg.tokens

    @property
    def cache(self) -> KVCache:
        return self.target.cache

    def next_chunk(self, rows: int) -> list[int]:
        return self.msg.tokens[self.fed : self.fed + rows]

    def computed(self, chunk: list[int], features: np.ndarray | None) -> None:
        """`chunk` went through the forward at `fed`, with these features (when the request wants them):
        they continue the run kept so far, or (after positions copied from another cache) start one.
        Once the whole prompt is in, the target keeps them (`features_of` sends them)."""
        if features is not None and self.target.keep_features:
            if self.fed != self.features_at + sum(len(f) for f in self.features):
                self.features, self.features_at = [], self.fed
            self.features.append(np.array(features, np.float32))  # a copy: the forward's rows are shared
        self.fed += len(chunk)
        if self.fed == len(self.tokens) and self.features:
            self.target.keep(self.features_at, np.concatenate(self.features))


@dataclass
class Request:
    target: TargetState
    step: int  # the last step executed
    reply: Opened | Verified | None = None
    probs: np.ndarray | None = None  # the admitted step's draft rows, decoded and checked
    seen: float = field(default_factory=time.monotonic)
    # The admitted step's draft as the forward runs it (the grammar's cut), and which of the sent
    # nodes that is (None: all).
    draft: Proposal = field(default_factory=lambda: Proposal([]))
    verified: list[int] | None = None


ALONE_ROWS = 512  # prompt rows per forward while no request decodes here (`prefill_budget`)


class Verifier:
    def __init__(
        self, model: Runtime, lane: LaneReporter, prefill_chunk: int = 128,
        row_costs: list[float] | None = None, watch: Stopwatch | None = None,
    ) -> None:  # fmt: skip
        self.model, self.lane, self.watch = model, lane, watch or Stopwatch()  # forwards: LoopPhase.FORWARD
        self.backend = backend_key(model)
        # The controllers' t(rows) (`model.calibration`), sent with every Opened.
        self.row_seconds = row_costs if row_costs is not None else row_seconds(model)
        self.prefill_chunk = prefill_chunk or model.cfg.context_length  # 0: a whole prompt per forward
        self.requests: dict[str, Request] = {}
        self.prefilling: dict[str, Prefill] = {}  # oldest first: chunks are fed in arrival order
        self.row_invariant: bool = getattr(model, "row_invariant", False)
        self.reuse = PrefixReuse(enabled=self.row_invariant)
        self.spans = StepSpans(lane.telemetry)  # per-step telemetry, a span per run of steps

    def forget(self, request_id: str) -> None:
        """The request leaves this lane (closed, re-opened, lost, idle): its state and its open span."""
        self.requests.pop(request_id, None)
        self.prefilling.pop(request_id, None)
        self.spans.end(request_id)

    def check_tokens(self, tokens: list[int]) -> str | None:
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            return f"token id out of range [0, {vocab})"
        return None

    def check_controls(self, msg: Open) -> str | None:
        """The controls must fit this model, and a re-prime's prompt must lie within its prefix."""
        if msg.prompt_length is not None and not 0 < msg.prompt_length <= len(msg.tokens):
            return f"prompt length {msg.prompt_length} for {len(msg.tokens)} tokens"
        return vocabulary_problem(msg.params, self.model.cfg.vocab_size)

    def open(self, msg: Open) -> Opened | StepFailed | None:
        """Validate an Open and queue its prefill; None while it is being fed."""
        known = self.requests.get(msg.request_id)
        if known and isinstance(known.reply, Opened) and known.step == msg.step:
            return known.reply
        queued = self.prefilling.get(msg.request_id)
        if queued is not None and queued.msg == msg:
            return None  # a repeat of an Open still being fed: its reply is on the way
        context = self.model.cfg.context_length
        if not msg.tokens or len(msg.tokens) >= context:
            return step_failed(
                self.lane, msg, "bad_request", f"{len(msg.tokens)} prompt tokens for a context of {context}"
            )
        if (problem := self.check_tokens(msg.tokens) or self.check_controls(msg)) is not None:
            return step_failed(self.lane, msg, "bad_request", problem)
        self.forget(msg.request_id)
        capacity = max(min(msg.capacity, context), len(msg.tokens) + 1)
        target = opened_target(self.model, msg, capacity)
        if isinstance(target, str):
            return step_failed(self.lane, msg, "bad_request", target)
        self.prefilling[msg.request_id] = Prefill(msg, target, time.time_ns())
        return None

    def prefill_chunks(self) -> list[tuple[Prefill, list[int]]]:
        """This forward's share of the waiting prompts: at most `prefill_budget()` rows, oldest first,
        each after copying what the caches here already hold of it."""
        holders = [Holder(r.target.context, r.target.cache) for r in self.requests.values()]
        return self.reuse.chunks(list(self.prefilling.values()), holders, self.prefill_budget())

    def prefill_budget(self) -> int:
        """`prefill_chunk` rows while requests decode here: each forward delays their steps. With
        none decoding there is nobody to stall, so up to ALONE_ROWS: a 134-token prompt in one forward,
        not 128 rows and then 6 (a second pass over every weight). Only on a row-invariant runtime,
        where the chunking changes no bit; elsewhere the rows a forward holds must not depend on
        which other requests happen to be here."""
        if self.requests or not self.row_invariant:
            return self.prefill_chunk
        return max(self.prefill_chunk, ALONE_ROWS)

    def finish_prefill(self, job: Prefill, last_logits: np.ndarray) -> Opened:
        """The prompt is in: sample the first token (a re-prime, sample=False, samples none)."""
        msg, target = job.msg, job.target
        del self.prefilling[msg.request_id]
        target.prefilled(msg.tokens)
        token, u = target.first_token(last_logits) if msg.sample else (None, None)
        reply = Opened(
            request_id=msg.request_id, step=msg.step, trace=msg.trace, token=token, u=u,
            draws=target.draws, seconds=(time.time_ns() - job.started_ns) / 1e9, backend=self.backend,
            row_seconds=self.row_seconds, logprobs=target.logprobs, **features_of(target),
        )  # fmt: skip
        self.requests[msg.request_id] = Request(target, msg.step, reply)
        self.lane.state.runs += msg.sample
        attributes = {
            "speclanes.request_id": msg.request_id, "speclanes.step": msg.step,
            "speclanes.tokens": len(msg.tokens), "speclanes.draws": msg.draws,
            "speclanes.prefill_chunk": self.prefill_chunk, "speclanes.prefix_reused": job.reused,
        }  # fmt: skip
        # A re-prime (sample=False) rebuilds a restarted lane's cache from the accepted prefix.
        name = "prefill" if msg.sample else "reprime"
        self.lane.telemetry.start(name, msg.trace, attributes, start_time=job.started_ns).end()
        return reply

    def admit(self, msg: Verify) -> Request | Verified | StepFailed:
        """The request to run this step for, a cached reply for a repeat, or why not."""
        request = self.requests.get(msg.request_id)
        if request is None:
            return step_failed(
                self.lane, msg, "unknown_request", "no state for this request here (re-prime it)"
            )
        request.seen = time.monotonic()
        if msg.step == request.step and isinstance(request.reply, Verified):
            return request.reply
        if msg.step != request.step + 1 or msg.position != request.target.cache.length:
            return step_failed(
                self.lane, msg, "unknown_request",
                f"step {msg.step} at position {msg.position}, but this lane is at step {request.step}, "
                f"position {request.target.cache.length}",
            )  # fmt: skip
        if (
            problem := self.check_tokens([msg.pending, *msg.drafts]) or check(msg.drafts, msg.parents)
        ) is not None:
            return step_failed(self.lane, msg, "bad_request", problem)
        if msg.parents is not None and msg.draft_probs is not None:
            return step_failed(self.lane, msg, "bad_request", "sampled drafts come as a chain, not a tree")
        if msg.position + 1 + len(msg.drafts) > self.model.cfg.context_length:
            return step_failed(
                self.lane,
                msg,
                "bad_request",
                f"{len(msg.drafts)} drafts at {msg.position} overrun the context",
            )
        if msg.draft_probs is not None:
            shape = msg.draft_probs.shape
            if shape != (len(msg.drafts), self.model.cfg.vocab_size):
                return step_failed(
                    self.lane, msg, "bad_request", f"draft rows of shape {shape} for {len(msg.drafts)} drafts"
                )
            try:
                request.probs = msg.draft_probs.array()
            except BadMessage as exc:
                return step_failed(self.lane, msg, "bad_request", str(exc))
        else:
            request.probs = None
        proposal = Proposal(msg.drafts, request.probs, "", msg.parents)
        request.draft, request.verified = request.target.narrow(proposal)  # the grammar's cut
        return request

    def step(self, batch: list[tuple[Verify, Request]]) -> list[Opened | Verified | StepFailed]:
        """One forward: every admitted verify step plus this forward's prefill chunks."""
        chunks = self.prefill_chunks()
        if not batch and not chunks:
            return []
        start, start_ns = time.perf_counter(), time.time_ns()
        work = [
            (
                request.target.cache,
                [msg.pending, *request.draft.tokens],
                None if request.draft.parents is None else rows_parents(request.draft.parents),
            )
            for msg, request in batch
        ]
        work += [(job.target.cache, chunk, None) for job, chunk in chunks]
        want = any(r.target.keep_features for _, r in batch) or any(j.target.keep_features for j, _ in chunks)
        # A prompt chunk needs its last row's logits only (the first token's, once the prompt is in),
        # not the LM head over its every row. Row invariance makes that row's bits the same either
        # way; the numpy reference, whose products sum in another order for another number of rows,
        # still computes every row, as it always has here.
        whole = [True] * len(batch) + [False] * len(chunks) if self.row_invariant else True
        try:  # every row's features when one request wants them (a copy of the final norm's rows)
            with self.watch.phase(LoopPhase.FORWARD):
                all_logits, found = self.model.forward_features(work, features=want, all_logits=whole)
        except Exception as exc:
            for msg, _ in batch:  # their caches may be half-written: a re-prime rebuilds them
                self.forget(msg.request_id)
            for job, _ in chunks:
                self.forget(job.msg.request_id)
            failed = [msg for msg, _ in batch] + [job.msg for job, _ in chunks]
            return [
                step_failed(self.lane, msg, "verification_failed", f"forward failed: {exc!r}")
                for msg in failed
            ]
        n, features = len(batch), found or [None] * len(work)
        replies: list[Opened | Verified | StepFailed] = []
        for (job, chunk), logits, rows in zip(chunks, all_logits[n:], features[n:], strict=True):
            job.computed(chunk, rows)
            if job.fed == len(job.msg.tokens):
                replies.append(self.finish_prefill(job, logits[-1]))
        if batch:
            replies.extend(self.conclude(batch, all_logits[:n], features[:n], start, start_ns))
        return replies

    def conclude(
        self, batch: list[tuple[Verify, Request]], all_logits: list[np.ndarray],
        features: list[np.ndarray | None], start: float, start_ns: int,
    ) -> list[Verified]:  # fmt: skip
        replies: list[Verified] = []
        rows = sum(1 + len(request.draft.tokens) for _, request in batch)
        for (msg, request), logits, found in zip(batch, all_logits, features, strict=True):
            target, draft = request.target, request.draft
            verdict = target.conclude(
                logits, draft.tokens, draft.probs, draft.parents, pending=msg.pending, features=found
            )
            request.step = msg.step
            request.reply = Verified(
                request_id=msg.request_id, step=msg.step, trace=msg.trace,
                tokens=verdict.tokens, accepted=verdict.accepted, decisions=verdict.decisions,
                final_u=verdict.final_u, draws=request.target.draws, batch_size=len(batch),
                seconds=time.perf_counter() - start, backend=self.backend, path=verdict.path,
                logprobs=target.logprobs, verified=request.verified, **features_of(target),
            )  # fmt: skip
            replies.append(request.reply)
            self.spans.step(msg, request.reply, start_ns, rows)
            state = self.lane.state
            state.drafted += len(draft.tokens)
            state.accepted += verdict.accepted
        self.lane.state.batches += 1
        self.lane.state.batched_rows += rows
        return replies

    def handle(
        self, messages: list[Open | Verify | Close | BadMessage]
    ) -> list[Opened | Verified | StepFailed]:
        replies: list[Opened | Verified | StepFailed] = []
        batch: dict[str, tuple[Verify, Request]] = {}
        later: list[Open | Verify | Close | BadMessage] = []
        for msg in messages:
            if isinstance(msg, BadMessage):
                self.lane.fault("bad_request", str(msg))
            elif isinstance(msg, Close):
                self.forget(msg.request_id)
            elif isinstance(msg, Open):
                if (reply := self.open(msg)) is not None:
                    replies.append(reply)
            elif msg.request_id in batch:
                later.append(msg)  # a second step of one request waits for this batch
            else:
                admitted = self.admit(msg)
                if isinstance(admitted, Request):
                    batch[msg.request_id] = (msg, admitted)
                else:
                    replies.append(admitted)
        replies.extend(self.step(list(batch.values())))
        if later:
            replies.extend(self.handle(later))
        self.lane.state.active_requests = len(self.requests)
        self.lane.state.prompt_tokens_reused = self.reuse.reused
        return replies

    def expire(self) -> None:
        cutoff = time.monotonic() - IDLE_SECONDS
        for request_id in [r for r, req in self.requests.items() if req.seen < cutoff]:
            self.forget(request_id)

    def busy(self) -> bool:
        """Prompts are still being fed: the lane must run another forward without waiting for mail."""
        return bool(self.prefilling)


def features_of(target: TargetState) -> dict[str, Any]:
    """An Opened's or Verified's `features` fields: the rows the target kept at its last prefill or step
    (none unless its request asked for them)."""
    if not target.keep_features or target.features is None:
        return {}
    return {"features": Rows.of(target.features), "features_at": target.features_at}


def runtime_report(model: Runtime) -> dict[str, object]:
    """What `status --json` shows for this lane: which numbers it computes, and on what CPU."""
    return {
        "backend": backend_key(model), "kernel_path": model.describe(), "cpu": cpu_name(),
        "cpu_flags": kernel_flags(),
    }  # fmt: skip
