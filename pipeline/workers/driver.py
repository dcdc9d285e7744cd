"""One request's decode loop, as the verify lane drives it: a state machine with no I/O.

The verify lane owns each admitted request's loop: it plans a step (the k policy of the request's
`Session`), asks the draft lane for a proposal when drafting pays, verifies it in the next batched
forward (or plainly, once the proposal's deadline has passed), and goes straight on to the next
step. Every decided step leaves as a `Decided` for the orchestrator, which journals, streams and
audits it; the orchestrator is never between two forwards.

Run-ahead is bounded: the driver starts a step only while it is fewer than `run_ahead` steps past
what the orchestrator has journaled (`StepsJournaled`). A step not yet journaled was never shown to
a client, and its recomputation is bit-identical (row invariance, position-keyed randomness), so a
crash anywhere loses nothing: the orchestrator re-primes the lane from its journal (`Open` with
`sample=False` and the journaled steps), and the driver rebuilds its session from those records,
exactly as the orchestrator rebuilds its own.

Faults only cost speed: a draft lane that is down, slow or failing, or a drafter that raises, turns a
step into plain decoding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.decoding.decided import ends_in_bonus
from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.session import Session
from pipeline.decoding.tree import chain, check, select, step_shape
from pipeline.protocol.messages import (
    BadMessage,
    Close,
    Decided,
    Drafted,
    DraftRequest,
    Open,
    Opened,
    Rows,
    StepEvent,
    StepFailed,
    StepRecord,
    Verified,
    Verify,
)
from pipeline.protocol.replay import apply
from pipeline.workers.kept_features import KeptFeatures, kept_features
from pipeline.workers.reporting import LaneReporter, origin_of


class DraftLane:
    """What the verify lane knows of the draft lane: whether a DraftRequest sent now can arrive (its
    socket is connected), and whether a proposal lately missed its deadline (then steps decode plainly
    for a while, rather than each waiting out its deadline). `here`: the drafters the verify lane runs
    itself, which need neither."""

    SLOW_SECONDS = 1.0

    def __init__(self, here: frozenset[str] = frozenset()) -> None:
        self.connected = True
        self.slow_until = -math.inf
        self.here = here

    def usable(self, now: float, drafter: str) -> bool:
        return drafter in self.here or (self.connected and now >= self.slow_until)

    def missed(self, now: float) -> None:
        self.slow_until = now + self.SLOW_SECONDS


class Out(NamedTuple):
    """A message the driver sends: to the lane's own `verifier`, to the `draft` lane, or to the
    orchestrator (`data`)."""

    lane: str  # verifier | draft | data
    message: Open | Verify | Close | DraftRequest | Decided | StepFailed


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


class Driver:
    # Over 250 lines: one request's whole loop in the verify lane, every reply and deadline in one place
    # (the pure parts are the functions below it: proposals, the verified part, features, audit events).
    def __init__(
        self, opened: Open, session: Session, lane: LaneReporter, draft_lane: DraftLane, draft_timeout: float,
        run_ahead: int, wall_offset: float = 0.0,
    ) -> None:  # fmt: skip
        """`wall_offset`: the wall clock minus the `now` passed in, for the audit events' times."""
        self.opened, self.session, self.lane, self.draft_lane = opened, session, lane, draft_lane
        self.draft_timeout, self.run_ahead, self.wall_offset = draft_timeout, run_ahead, wall_offset
        self.step = opened.step  # the last decided step
        self.draws = opened.draws
        self.journaled = opened.step  # the orchestrator holds every step up to this one
        self.planned: Planned | None = None
        self.pending: Open | DraftRequest | Verify | None = None
        self.deadline = math.inf  # for the pending DraftRequest
        self.held = False  # a step is planned but waits for the journal to catch up
        self.over = False
        self.neighbours = 0  # other requests sharing the forwards (set by the core)
        self.features: KeptFeatures | None = None  # for the next DraftRequest (`kept_features`)

    @property
    def id(self) -> str:
        return self.opened.request_id

    @property
    def waiting_for_draft(self) -> bool:
        return isinstance(self.pending, DraftRequest)

    @property
    def waiting_for_open(self) -> bool:
        """Its Open is queued for the verifier, which does not know the request yet."""
        return isinstance(self.pending, Open)

    # --- inputs ------------------------------------------------------------------------

    def begin(self, now: float) -> list[Out]:
        """Hand the Open to the verifier: a new prompt's prefill, or a re-prime's prefix."""
        self.pending = self.opened
        if not self.opened.sample:
            self.session_replay(self.opened.history)
        return [Out("verifier", self.opened)]

    def on_reply(self, msg: Opened | Verified | Drafted | StepFailed, now: float) -> list[Out]:
        pending = self.pending
        if self.over or pending is None or msg.step != pending.step or not matches(pending, msg):
            return []  # late or repeated: already dealt with
        self.pending, self.deadline = None, math.inf
        if isinstance(msg, Opened | Verified) and msg.features is not None:
            self.features = kept_features(self.features, msg.features_at, msg.features)
        if isinstance(msg, StepFailed):
            if msg.origin == "draft":  # a drafter failed (reported where it ran): this step goes plain
                return self._verify_step(now)
            self.over = True
            return [Out("data", msg)]
        if isinstance(msg, Drafted):
            return self._drafted(msg, now)
        if isinstance(msg, Opened):
            if msg.row_seconds and self.session.controller.fixed is None:
                self.session.controller.costs.calibrate(msg.row_seconds)
            if not self.opened.sample:  # re-primed: carry on from the journaled step
                return self._next(now, None)
            record = first_step(msg)
            return self._decided(record, step_event(self, None, msg, now), now)
        return self._verified(msg, now)

    def journaled_to(self, step: int, now: float) -> list[Out]:
        """The orchestrator has journaled up to `step`: a step held back may start."""
        self.journaled = max(self.journaled, step)
        if not self.held or self.step - self.journaled >= self.run_ahead:
            return []
        self.held = False
        return self._plan(now)

    def draft_unsent(self, now: float) -> list[Out]:
        """The draft lane could not take the request: this step decodes plainly."""
        if not isinstance(self.pending, DraftRequest):
            return []
        self.pending = None
        return self._verify_step(now)

    def tick(self, now: float) -> list[Out]:
        """A proposal past its deadline is given up: the step decodes plainly."""
        if self.over or now < self.deadline or not isinstance(self.pending, DraftRequest):
            return []
        self.pending = None
        self.draft_lane.missed(now)
        message = f"no draft for step {self.step + 1} in time; decoding plainly"
        self.lane.fault("timeout", message, self.id, self.step + 1, self.opened.trace)
        return self._verify_step(now)

    def close(self) -> list[Out]:
        """The orchestrator ended the request (cancelled, a stop it found, shutdown)."""
        self.over = True
        return self._release()

    # --- steps -------------------------------------------------------------------------

    def session_replay(self, records: list[StepRecord]) -> None:
        """The journaled steps, fed to the session as they first were (a re-prime)."""
        for record in records:
            self._book(record)

    def _book(self, record: StepRecord) -> None:
        apply(self.session, record)
        self.step, self.draws = record.step, record.draws

    def _decided(self, record: StepRecord, event: StepEvent, now: float) -> list[Out]:
        self._book(record)
        return self._next(now, (record, event))

    def _next(self, now: float, decided: tuple[StepRecord, StepEvent] | None) -> list[Out]:
        """After a decided step (or a re-prime): tell the orchestrator, then plan the next step, or end."""
        want = self.session.plan(self.neighbours)
        self.planned = None if want is None else Planned(want)
        out: list[Out] = []
        if decided is not None or want is None:
            record, event = decided or (None, None)
            message = Decided(
                request_id=self.id, step=self.step, trace=self.opened.trace, record=record, event=event,
                over=want is None, epoch=self.opened.epoch,
            )  # fmt: skip
            out.append(Out("data", message))
        if want is None:
            self.over = True
            return out + self._release()
        if self.step - self.journaled >= self.run_ahead:
            self.held = True
            return out
        return out + self._plan(now)

    def _plan(self, now: float) -> list[Out]:
        """Ask for drafts if worth it, else verify plainly."""
        planned, session = self.planned, self.session
        assert planned is not None
        if planned.want == 0 or not self.draft_lane.usable(now, session.drafter):
            return self._verify_step(now)
        features_at, features = self.features.taken() if self.features is not None else (0, None)
        planned.draft_started = now
        opened = self.opened
        self.pending = DraftRequest(
            request_id=self.id, step=self.step + 1, drafter=session.drafter, params=session.params,
            seed=opened.seed, prompt_length=len(session.prompt_tokens), context=session.context,
            k=planned.want, tree=session.tree, floor=session.floor(), trace=opened.trace,
            features=features, features_at=features_at,
        )  # fmt: skip
        self.features = None  # each batch goes to the draft lane once
        self.deadline = now + self.draft_timeout
        return [Out("draft", self.pending)]

    def _drafted(self, msg: Drafted, now: float) -> list[Out]:
        planned = self.planned
        assert planned is not None
        proposal, problem = proposal_of(msg)
        if problem is not None:
            self.lane.fault("bad_request", problem, self.id, msg.step, self.opened.trace)
        draft = self.session.cut(proposal, planned.want, self.neighbours)
        planned.drafts, planned.drafter = tuple(draft.tokens), msg.drafter
        planned.parents, planned.shares = draft.parents, draft.shares
        planned.rows = None if draft.probs is None or not draft.tokens else Rows.of(draft.probs)
        planned.draft_seconds = now - planned.draft_started
        return self._verify_step(now)

    def _verify_step(self, now: float) -> list[Out]:
        planned, session = self.planned, self.session
        assert planned is not None
        planned.verify_started = now
        self.pending = Verify(
            request_id=self.id, step=self.step + 1, position=len(session.context) - 1,
            pending=session.context[-1], drafts=list(planned.drafts),
            draft_probs=planned.rows if planned.drafts else None, parents=planned.parents,
            trace=self.opened.trace,
        )  # fmt: skip
        return [Out("verifier", self.pending)]

    def _verified(self, msg: Verified, now: float) -> list[Out]:
        assert self.planned is not None
        planned = self.planned = verified_part(self.planned, msg.verified)
        depth, offered = step_shape(planned.parents, planned.shares, len(planned.drafts), msg.path)
        record = StepRecord(
            msg.step, len(planned.drafts), list(msg.tokens), msg.accepted, planned.draft_seconds,
            now - planned.verify_started, msg.draws, planned.drafter, depth, offered, msg.logprobs,
            ends_in_bonus(planned.parents, len(planned.drafts), msg.path),
        )  # fmt: skip
        return self._decided(record, step_event(self, planned, msg, now), now)

    def _release(self) -> list[Out]:
        """Free this request's state in the verifier and the draft lane (best effort: lanes also
        expire idle state); the draft lane's cross-request cache learns from the context."""
        self.pending, self.deadline = None, math.inf
        return [
            Out("verifier", Close(request_id=self.id)),
            Out("draft", Close(request_id=self.id, context=self.session.context)),
        ]


def matches(pending: Open | DraftRequest | Verify, reply: Opened | Verified | Drafted | StepFailed) -> bool:
    """Whether `reply` answers `pending` (the same step is not enough: a draft's reply must be a draft's)."""
    if isinstance(reply, StepFailed):
        return reply.origin == origin_of(pending)
    expected = {Open: Opened, Verify: Verified, DraftRequest: Drafted}[type(pending)]
    return isinstance(reply, expected)


def verified_part(planned: Planned, verified: list[int] | None) -> Planned:
    """The part of the planned draft the verifier ran (`Verified.verified`: a grammar cut the
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


def proposal_of(msg: Drafted) -> tuple[Proposal, str | None]:
    """The draft lane's proposal as the session cuts it; one whose rows do not fit their shape,
    or whose tree is not a tree, is no proposal (the step decodes plainly), and the former is a fault."""
    try:
        probs = None if msg.probs is None else msg.probs.array()
    except BadMessage as exc:
        return EMPTY, f"draft rows for step {msg.step}: {exc}"
    if check(msg.tokens, msg.parents) is not None:
        return EMPTY, None
    return Proposal(msg.tokens, probs, msg.drafter, msg.parents, msg.shares), None


def first_step(msg: Opened) -> StepRecord:
    """Step 0 as the journal keeps it: the prefill's first token (its time, the lane's prefill time;
    the orchestrator books its own, from admission), and its entry when asked for."""
    assert msg.token is not None
    return StepRecord(0, 0, [msg.token], 0, 0.0, msg.seconds, msg.draws, logprobs=msg.logprobs)


def step_event(driver: Driver, planned: Planned | None, reply: Opened | Verified, now: float) -> StepEvent:
    """The step for the audit trail (step 0 is the prefill that sampled the first token)."""
    if isinstance(reply, Opened):
        emitted, decisions, final_u, batch = [reply.token], [], reply.u, 1
    else:
        emitted, decisions, final_u = list(reply.tokens), reply.decisions, reply.final_u
        batch = reply.batch_size
    request_id, time = driver.id, now + driver.wall_offset
    return StepEvent(
        event_id=f"{request_id}:step:{reply.step}", request_id=request_id, time=time, step=reply.step,
        drafter=planned.drafter if planned else "", k=planned.want if planned else 0,
        drafted=list(planned.drafts) if planned else [], emitted=emitted, decisions=decisions,
        final_u=final_u, draws=reply.draws, batch_size=batch, backend=reply.backend,
        parents=planned.parents if planned else None, trace=driver.opened.trace,
    )  # fmt: skip
