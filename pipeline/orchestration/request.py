"""One request's step protocol, as a state machine with no I/O.

It owns the request's accepted tokens (a `Session`) and knows the one message it is waiting
for: the Open of its prompt, a DraftRequest, a Verify, or the Open that re-primes a verify
lane that lost the request. Each reply, timeout or lane change advances it and returns
`effects` (messages to send, events to record). Faults only cost speed:
- a draft lane that is down, slow or failing turns the step into plain decoding;
- a verify lane that restarts gets the pending message again, and a verify lane that answers
  "unknown request" is re-primed from the accepted prefix, then asked the same step again;
- any other verify failure ends the request with an error result.
Replies that do not match the pending message (late, repeated) change nothing.

Every decided step leaves as a `Journaled` effect, and `replay` rebuilds a machine from those
records: a restarted orchestrator carries on from the last step any client can have seen.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipeline.decoding.decided import ends_in_bonus, letters
from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.drafters.kinds import paid_per_draft
from pipeline.decoding.result import Result
from pipeline.decoding.session import Session
from pipeline.decoding.tree import chain, check, select, step_shape
from pipeline.orchestration.effects import (
    DraftLaneSlow,
    Effect,
    FirstToken,
    Journaled,
    Raise,
    Record,
    Send,
    Stepped,
)
from pipeline.orchestration.journal import StepRecord
from pipeline.orchestration.lane_table import LaneTable
from pipeline.protocol.config import Timeouts
from pipeline.protocol.messages import (
    BadMessage,
    Chunk,
    Close,
    Drafted,
    DraftRequest,
    Open,
    Opened,
    Rows,
    StepEvent,
    StepFailed,
    Verified,
    Verify,
)

Reply = Opened | Verified | Drafted | StepFailed
# The target's features a request keeps for its drafter while no DraftRequest takes them (steps that
# draft nothing, a draft lane that is down): the latest, a bounded history for a learned drafter.
MAX_KEPT_FEATURES = 2048
KIND = {
    Open: "open",
    Verify: "verify",
    DraftRequest: "draft",
    Opened: "open",
    Verified: "verify",
    Drafted: "draft",
}


@dataclass(frozen=True)
class Identity:
    """What a request is, fixed at admission."""

    id: str
    seed: int
    drafter: str
    trace: dict[str, str]
    started: float  # monotonic
    submitted: float  # wall clock, for the audit trail
    features: bool = False  # its drafter reads the target's features: the verify lane sends them


@dataclass
class Planned:
    """The step being prepared: how many draft nodes it may verify, what is verified (a chain, or
    a tree: `parents`, with the drafter's `shares`) and how fast it was drafted."""

    want: int
    drafter: str = ""
    drafts: tuple[int, ...] = ()
    rows: Rows | None = None
    parents: list[int] | None = None
    shares: list[float] | None = None
    draft_started: float = 0.0
    draft_seconds: float = 0.0
    verify_started: float = 0.0


class RequestMachine:
    # Over 250 lines: one request's whole step protocol in one place, every reply, fault and lane change
    # (the pure parts are the functions below it: proposals, the verified part, features, audit events).
    def __init__(self, who: Identity, session: Session, lanes: LaneTable, timeouts: Timeouts) -> None:
        self.who, self.session, self.lanes, self.timeouts = who, session, lanes, timeouts
        self.step = 0  # the last completed step
        self.draws = 0  # uniforms the verifier has spent for this request
        self.chunks: list[Chunk] = []
        self.result: Result | None = None
        self.pending: Open | Verify | DraftRequest | None = None
        self.deadline = math.inf
        self.planned: Planned | None = None
        self.prefill_seconds = 0.0
        self.waiting_for_verify_lane = False
        self.neighbours = 0  # other requests sharing the verify lane's forwards (set by the hub)
        self.features: tuple[int, Rows] | None = None  # (position, rows) for the next DraftRequest

    @property
    def id(self) -> str:
        return self.who.id

    @property
    def done(self) -> bool:
        return self.result is not None

    # --- inputs ------------------------------------------------------------------------

    def begin(self, now: float) -> list[Effect]:
        session = self.session
        return self._to_verify(
            Open(
                request_id=self.id, step=0, tokens=session.prompt_tokens, params=session.params,
                seed=self.who.seed, capacity=session.capacity(), trace=self.who.trace,
                features=self.who.features,
            ),
            now,
        )  # fmt: skip

    def on_reply(self, msg: Reply, now: float) -> list[Effect]:
        pending = self.pending
        kind = msg.origin if isinstance(msg, StepFailed) else KIND[type(msg)]
        if self.done or pending is None or kind != KIND[type(pending)] or msg.step != pending.step:
            return []  # late or repeated: already dealt with
        self.pending, self.deadline = None, math.inf
        if isinstance(msg, Opened | Verified) and msg.features is not None:
            self.features = kept_features(self.features, msg.features_at, msg.features)
        if isinstance(msg, StepFailed):
            return self._failed(msg, now)
        if isinstance(msg, Drafted):
            return self._drafted(msg, now)
        if isinstance(msg, Opened):
            assert isinstance(pending, Open)
            if msg.row_seconds and self.session.controller.fixed is None:
                self.session.controller.costs.calibrate(msg.row_seconds)
            if not pending.sample:  # the lane is re-primed: ask it the lost step again (none after
                return self._verify_step(now) if self.planned else self._advance(now)  # a replay)
            return self._opened(msg, now)
        return self._verified(msg, now)

    def verify_lane_up(self, now: float) -> list[Effect]:
        """Send again what a verify lane that went down (or was not yet up) never answered."""
        if not self.waiting_for_verify_lane or not isinstance(self.pending, Open | Verify):
            return []
        return self._to_verify(self.pending, now)

    def lane_down(self, lane: str, now: float) -> list[Effect]:
        if isinstance(self.pending, DraftRequest) and lane == "draft":
            self.pending = None
            return self._verify_step(now)
        if isinstance(self.pending, Open | Verify) and lane == "verify":
            self.waiting_for_verify_lane, self.deadline = True, math.inf
        return []

    def draft_unsent(self, now: float) -> list[Effect]:
        """The draft lane could not take the request: this step decodes plainly."""
        if not isinstance(self.pending, DraftRequest):
            return []
        self.pending = None
        return self._verify_step(now)

    def tick(self, now: float) -> list[Effect]:
        if self.done or now < self.deadline or self.pending is None:
            return []
        pending = self.pending
        if isinstance(pending, DraftRequest):
            self.pending = None
            message = f"no draft for step {pending.step} in time; decoding plainly"
            return [DraftLaneSlow(), Raise("timeout", "draft", message, self.id), *self._verify_step(now)]
        message = f"no answer to {KIND[type(pending)]} step {pending.step}; re-sending"
        return [Raise("timeout", "verify", message, self.id), *self._to_verify(pending, now)]

    def cancel(self, now: float, reason: str = "cancelled") -> list[Effect]:  # server_shutdown, storage_full
        return [] if self.done else self._finish(now, reason)

    # --- after an orchestrator restart ---------------------------------------------------

    def replay(self, records: list[StepRecord], result: Result | None) -> None:
        """Rebuild the accepted tokens, chunks, counters and k policy from the journal, exactly as
        the steps first built them (the session is a pure function of what it was fed)."""
        for record in records:
            self._apply(record)
        if result is not None:  # what `_finish` released last: text held back until the end
            released = "".join(chunk.text for chunk in self.chunks)
            self._emit(result.text[len(released) :], len(self.session.out.tokens))
            self.result = result

    def resume(self, now: float) -> list[Effect]:
        """Carry on after `replay`: re-prime the verify lane from the accepted prefix (it may hold
        this request at a later step the journal never saw), or open it afresh if no token was
        decided yet; a finished request only frees the lanes again."""
        if self.done:
            return self._release()
        return self._reprime(now) if self.session.out.tokens else self.begin(now)

    # --- steps -------------------------------------------------------------------------

    def _to_verify(self, msg: Open | Verify, now: float) -> list[Effect]:
        self.pending = msg
        if not self.lanes.is_up("verify"):
            self.waiting_for_verify_lane, self.deadline = True, math.inf
            return []
        timeout = self.timeouts.verify
        if isinstance(msg, Open):
            timeout += self.timeouts.prefill_per_token * len(msg.tokens)
        self.waiting_for_verify_lane, self.deadline = False, now + timeout
        return [Send("verify", msg)]

    def _advance(self, now: float) -> list[Effect]:
        """Plan the next step: ask for drafts if worth it, else verify plainly; or finish."""
        want = self.session.plan()
        if want is None:
            return self._finish(now)
        self.planned = Planned(want)
        if want == 0 or not self.lanes.usable("draft"):
            return self._verify_step(now)
        session, (features_at, features) = self.session, self.features or (0, None)
        self.planned.draft_started = now
        self.pending = DraftRequest(
            request_id=self.id, step=self.step + 1, drafter=self.who.drafter, params=session.params,
            seed=self.who.seed, prompt_length=len(session.prompt_tokens), context=session.context,
            k=want, tree=session.tree, floor=session.floor(), trace=self.who.trace, features=features,
            features_at=features_at,
        )  # fmt: skip
        self.features = None  # each batch goes to the draft lane once
        self.deadline = now + self.timeouts.draft
        return [Send("draft", self.pending)]

    def _drafted(self, msg: Drafted, now: float) -> list[Effect]:
        planned = self.planned
        assert planned is not None
        proposal, effects = proposal_of(msg, self.id)
        draft = self.session.cut(proposal, planned.want, self.neighbours)
        planned.drafts, planned.drafter = tuple(draft.tokens), msg.drafter
        planned.parents, planned.shares = draft.parents, draft.shares
        planned.rows = None if draft.probs is None or not draft.tokens else Rows.of(draft.probs)
        planned.draft_seconds = now - planned.draft_started
        return effects + self._verify_step(now)

    def _verify_step(self, now: float) -> list[Effect]:
        planned, session = self.planned, self.session
        assert planned is not None
        planned.verify_started = now
        return self._to_verify(
            Verify(
                request_id=self.id, step=self.step + 1, position=len(session.context) - 1,
                pending=session.context[-1], drafts=list(planned.drafts),
                draft_probs=planned.rows if planned.drafts else None, parents=planned.parents,
                trace=self.who.trace,
            ),
            now,
        )  # fmt: skip

    def _opened(self, msg: Opened, now: float) -> list[Effect]:
        record = first_step(msg, now - self.who.started)
        self._apply(record)
        event = Record(step_event(self.who, None, msg, now))
        return [Journaled(record), FirstToken(record.verify_seconds), event, *self._advance(now)]

    def _verified(self, msg: Verified, now: float) -> list[Effect]:
        assert self.planned is not None
        planned = self.planned = verified_part(self.planned, msg.verified)
        depth, offered = step_shape(planned.parents, planned.shares, len(planned.drafts), msg.path)
        record = StepRecord(
            msg.step, len(planned.drafts), list(msg.tokens), msg.accepted, planned.draft_seconds,
            now - planned.verify_started, msg.draws, planned.drafter, depth, offered, msg.logprobs,
            ends_in_bonus(planned.parents, len(planned.drafts), msg.path),
        )  # fmt: skip
        self._apply(record)
        stepped = Stepped(
            record.drafter, record.drafted, record.accepted, record.draft_seconds, record.verify_seconds
        )
        event = Record(step_event(self.who, planned, msg, now))
        return [Journaled(record), stepped, event, *self._advance(now)]

    def _apply(self, record: StepRecord) -> None:
        """A decided step into the session and the chunks: the same code live and in `replay`."""
        session, before = self.session, len(self.session.out.tokens)
        if record.step == 0:
            self.prefill_seconds = record.verify_seconds
            text = session.start(record.tokens[0], record.logprobs)
        else:
            text = session.record(
                record.drafted, record.tokens, record.accepted, record.draft_seconds, record.verify_seconds,
                depth=record.depth, offered=record.offered, drafter=record.drafter,
                paid_drafts=record.drafted if paid_per_draft(record.drafter) else 0, logprobs=record.logprobs,
            )  # fmt: skip
        self.step, self.draws = record.step, record.draws
        count = len(session.out.tokens) - before
        self._emit(text, before, letters(record.drafted, record.accepted, record.bonus, count))

    def _failed(self, msg: StepFailed, now: float) -> list[Effect]:
        if msg.origin == "draft":
            return self._verify_step(now)  # the draft lane reported it: this step decodes plainly
        if msg.kind == "unknown_request" and msg.origin == "verify":
            return self._reprime(now)
        self.result = Result.failed(self.id, msg.kind, msg.message)
        return [Raise(msg.kind, "verify", msg.message, self.id), *self._release()]

    def _reprime(self, now: float) -> list[Effect]:
        """Rebuild the verify lane's state for this request from the accepted prefix, with the
        draw count it had, sampling nothing: the lane then stands where the last step left it."""
        session = self.session
        return self._to_verify(
            Open(
                request_id=self.id, step=self.step, tokens=session.context[:-1], params=session.params,
                seed=self.who.seed, draws=self.draws, sample=False, capacity=session.capacity(),
                prompt_length=len(session.prompt_tokens), pending=session.context[-1], trace=self.who.trace,
                features=self.who.features,
            ),
            now,
        )  # fmt: skip

    def _finish(self, now: float, reason: str | None = None) -> list[Effect]:
        session = self.session
        self._emit(session.finish_text(), len(session.out.tokens))
        effects: list[Effect] = []
        if session.out.finish_reason == "max_iterations_exceeded":
            effects.append(
                Raise("max_iterations_exceeded", "orchestrator", "ended after the step limit", self.id)
            )
        self.result = session.result(
            wall=now - self.who.started, prefill_seconds=self.prefill_seconds, seed=self.who.seed,
            drafter=self.who.drafter, request_id=self.id, finish_reason=reason,
        )  # fmt: skip
        return effects + self._release()

    def _release(self) -> list[Effect]:
        """Free the lanes' state (best effort: lanes also expire idle state)."""
        self.pending, self.deadline = None, math.inf
        return [
            Send("verify", Close(request_id=self.id)),
            Send("draft", Close(request_id=self.id, context=self.session.context)),
        ]

    # --- output ------------------------------------------------------------------------

    def _emit(self, text: str, before: int, decided: str = "") -> None:
        tokens = self.session.out.tokens[before:]
        if text or tokens:
            self.chunks.append(Chunk(len(self.chunks), text, tokens, self.session.logprobs[before:], decided))


def kept_features(kept: tuple[int, Rows] | None, at: int, rows: Rows) -> tuple[int, Rows] | None:
    """`rows` (the target's features at positions [at, ...)) after those kept: joined to them where they
    continue or overlap them (steps that asked for no draft), else in their place (a gap: the drafter
    starts its history again there). At most MAX_KEPT_FEATURES, the latest; rows whose bytes do not
    fit their shape are none."""
    n, width = rows.shape
    size = width * 4
    if width <= 0 or at < 0 or rows.problem() is not None:
        return kept
    if kept is not None and kept[1].shape[1] == width and kept[0] <= at <= kept[0] + kept[1].shape[0]:
        data = kept[1].data[: (at - kept[0]) * size] + rows.data
        at, n, rows = kept[0], len(data) // size, Rows((len(data) // size, width), data)
    if n > MAX_KEPT_FEATURES:
        cut = n - MAX_KEPT_FEATURES
        at, rows = at + cut, Rows((MAX_KEPT_FEATURES, width), rows.data[cut * size :])
    return at, rows


def verified_part(planned: Planned, verified: list[int] | None) -> Planned:
    """The part of the planned draft the verify lane ran (`Verified.verified`: a grammar cut the
    nodes it forbids before the forward). The stats, the controller and the audit trail book that
    part only: nodes never offered to the target are neither drafted nor rejected."""
    if verified is None:
        return planned
    tokens = tuple(planned.drafts[i] for i in verified)
    parents = select(chain(len(planned.drafts)) if planned.parents is None else planned.parents, verified)
    shares = None if planned.shares is None else [planned.shares[i] for i in verified]
    rows = None if planned.rows is None or not tokens else Rows.of(planned.rows.array()[: len(tokens)])
    shape = None if parents == chain(len(tokens)) else parents
    return dataclasses.replace(planned, drafts=tokens, parents=shape, shares=shares, rows=rows)


def proposal_of(msg: Drafted, request_id: str) -> tuple[Proposal, list[Effect]]:
    """The draft lane's proposal as the session cuts it; one whose rows do not fit their shape,
    or whose tree is not a tree, is no proposal (the step decodes plainly), and the former is a fault."""
    try:
        probs = None if msg.probs is None else msg.probs.array()
    except BadMessage as exc:
        return EMPTY, [Raise("bad_request", "draft", f"draft rows for step {msg.step}: {exc}", request_id)]
    if check(msg.tokens, msg.parents) is not None:
        return EMPTY, []
    return Proposal(msg.tokens, probs, msg.drafter, msg.parents, msg.shares), []


def first_step(msg: Opened, prefill_seconds: float) -> StepRecord:
    """Step 0 as the journal keeps it: the prefill's first token, and its entry when asked for."""
    assert msg.token is not None
    return StepRecord(0, 0, [msg.token], 0, 0.0, prefill_seconds, msg.draws, logprobs=msg.logprobs)


def step_event(who: Identity, planned: Planned | None, reply: Opened | Verified, now: float) -> StepEvent:
    """The step for the audit trail (step 0 is the prefill that sampled the first token)."""
    if isinstance(reply, Opened):
        planned, emitted, decisions, final_u, batch = None, [reply.token], [], reply.u, 1
    else:
        emitted, decisions, final_u, batch = (
            list(reply.tokens),
            reply.decisions,
            reply.final_u,
            reply.batch_size,
        )
    return StepEvent(
        event_id=f"{who.id}:step:{reply.step}", request_id=who.id,
        time=who.submitted + (now - who.started), step=reply.step,
        drafter=planned.drafter if planned else "", k=planned.want if planned else 0,
        drafted=list(planned.drafts) if planned else [], emitted=emitted, decisions=decisions,
        final_u=final_u, draws=reply.draws, batch_size=batch, backend=reply.backend,
        parents=planned.parents if planned else None,
    )  # fmt: skip
