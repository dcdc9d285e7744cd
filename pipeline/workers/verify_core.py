"""The verify lane's I/O-free core: the `Verifier` and one `Driver` per admitted request.

What arrives (Open, Close and StepsJournaled from the orchestrator, Drafted or a draft's StepFailed
from the draft lane)
goes to the drivers; what the drivers ask of the verifier waits in `queued` for the next batched
forward, which `forward` runs; everything else they send comes back as `Out`s for the lane process
(lanes/verify.py) to put on its sockets. After a forward each driver plans its next step at once:
a plain step is queued for the very next forward, and so is a step whose drafter runs here
(`local`, `run.draft_in_verify_lane`): its proposal is made on the spot; a step drafted by the
draft lane waits for its proposal (or its deadline). The orchestrator is never waited for, unless
a request is `run.run_ahead` steps ahead of its journal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipeline.decoding.session import Session
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    BadMessage,
    Close,
    Decided,
    Drafted,
    DraftRequest,
    Open,
    StepFailed,
    StepsJournaled,
    Verify,
    VerifyInbox,
)
from pipeline.workers.draft_server import DraftServer
from pipeline.workers.driver import DraftLane, Driver, Out
from pipeline.workers.loop_phases import LoopPhase
from pipeline.workers.reporting import LaneReporter, step_failed
from pipeline.workers.verifier import Verifier

log = logging.getLogger(__name__)


class VerifyCore:
    def __init__(
        self, verifier: Verifier, lane: LaneReporter, config: Config, *, clock: Callable[[], float],
        wall_offset: float = 0.0, local: DraftServer | None = None,
    ) -> None:  # fmt: skip
        """`clock`: the time the `now`s passed in are read from (a proposal made here is dated by it);
        `wall_offset`: the wall clock minus that time (audit events carry wall times); `local`: the
        drafters this lane answers itself (`registry.split_by_lane`)."""
        model = verifier.model
        assert model.tokenizer is not None
        self.verifier, self.lane, self.config, self.wall_offset = verifier, lane, config, wall_offset
        self.clock = clock
        self.tokenizer, self.context_length = model.tokenizer, model.cfg.context_length
        self.drivers: dict[str, Driver] = {}
        self.queued: list[Open | Verify | Close] = []  # for the verifier's next forward
        self.draft_lane = DraftLane(frozenset(local.sources) if local is not None else frozenset())
        self.local = local

    # --- inputs ------------------------------------------------------------------------

    def receive(self, msg: VerifyInbox | BadMessage, now: float) -> list[Out]:
        if isinstance(msg, BadMessage):
            self.lane.fault("bad_request", str(msg))
            return []
        if isinstance(msg, Open):
            return self.open(msg, now)
        if isinstance(msg, Close):
            driver = self.drivers.pop(msg.request_id, None)
            self.unqueue(msg.request_id)
            return self.route(driver.close() if driver else [Out("verifier", msg)])
        if isinstance(msg, StepsJournaled):
            out: list[Out] = []
            for request_id, step in msg.steps.items():
                if (driver := self.drivers.get(request_id)) is not None:
                    out += driver.journaled_to(step, now)
            return self.route(out)
        if isinstance(msg, StepFailed) and msg.origin != "draft":
            self.lane.fault("bad_request", f"a StepFailed for {msg.origin!r} work came to the verify lane")
            return []
        driver = self.drivers.get(msg.request_id)
        return self.route(driver.on_reply(msg, now)) if driver else []

    def open(self, msg: Open, now: float) -> list[Out]:
        """A new request, or a re-prime: its driver (re)starts from the Open. An Open comes again only
        when the orchestrator missed what followed the first (it restarted, a Decided was lost): the
        driver starts again from it, and decides the same steps again."""
        self.drivers.pop(msg.request_id, None)
        self.unqueue(msg.request_id)
        prompt = msg.tokens[: msg.prompt_length] if msg.prompt_length is not None else msg.tokens
        try:
            session = Session(self.tokenizer, self.context_length, prompt, msg.params, msg.speculation)
        except ValueError as exc:
            fault = StepFailed(
                request_id=msg.request_id, step=msg.step, origin="open", kind="bad_request", message=str(exc)
            )
            return [Out("data", fault)]
        draft_timeout, run_ahead = self.config.timeouts.draft, self.config.run.run_ahead
        driver = Driver(msg, session, self.lane, self.draft_lane, draft_timeout, run_ahead, self.wall_offset)
        self.drivers[msg.request_id] = driver
        return self.route(driver.begin(now))

    def draft_unsent(self, request_id: str, now: float) -> list[Out]:
        """The draft lane's socket did not take a DraftRequest: that step decodes plainly."""
        driver = self.drivers.get(request_id)
        return self.route(driver.draft_unsent(now)) if driver else []

    def tick(self, now: float) -> list[Out]:
        """Proposals past their deadline are given up (those steps decode plainly)."""
        out: list[Out] = []
        for driver in list(self.drivers.values()):
            out += driver.tick(now)
        return self.route(out)

    # --- the forward -------------------------------------------------------------------

    def has_work(self) -> bool:
        """A forward is due: steps or prompts are waiting for it."""
        return bool(self.queued) or self.verifier.busy()

    def awaiting_drafts(self) -> bool:
        return any(driver.waiting_for_draft for driver in self.drivers.values())

    def next_deadline(self) -> float:
        return min((d.deadline for d in self.drivers.values()), default=float("inf"))

    def forward(self, clock: Callable[[], float]) -> list[Out]:
        """One batched forward of every queued step and this forward's prefill chunks; each driver
        then takes its reply and plans its next step. `clock` is read once the forward has run, so
        a step's verify time is its forward's, and its next draft's time starts after it."""
        messages, self.queued = self.queued, []
        neighbours = max(0, len(self.drivers) - 1)
        for driver in self.drivers.values():
            driver.neighbours = neighbours
        try:
            replies = self.verifier.handle(messages)
        except Exception as exc:  # a bug costs these requests a re-prime, never the lane
            log.exception("verify step failed")
            message = f"unexpected {exc!r}; the requests involved will be re-primed"
            self.lane.fault("verification_failed", message)
            return self.lost([m for m in messages if not isinstance(m, Close)])
        out: list[Out] = []
        now = clock()
        for reply in replies:
            if (driver := self.drivers.get(reply.request_id)) is not None:
                out += driver.on_reply(reply, now)
        return self.route(out)

    def lost(self, messages: list[Open | Verify]) -> list[Out]:
        """Their state here may be half-written: forget it, and have the orchestrator re-prime them."""
        out: list[Out] = []
        for msg in messages:
            self.verifier.forget(msg.request_id)
            if self.drivers.pop(msg.request_id, None) is not None:
                failed = step_failed(self.lane, msg, "unknown_request", "this lane lost the request's state")
                out.append(Out("data", failed))
        return out

    def expire(self) -> None:
        """Requests not heard of for `verifier.IDLE_SECONDS` (their orchestrator is gone, their Close
        was lost) leave the lane, drivers included."""
        self.verifier.expire()
        for request_id in [r for r in self.drivers if r not in self.verifier.requests]:
            if request_id not in self.verifier.prefilling and not self.drivers[request_id].waiting_for_open:
                del self.drivers[request_id]

    # --- plumbing ----------------------------------------------------------------------

    def route(self, out: list[Out]) -> list[Out]:
        """Queue what is for the verifier; answer what is for a drafter that runs here; drop drivers
        that are over; the rest leaves the lane."""
        leaving: list[Out] = []
        for item in out:
            if item.lane == "verifier":
                self.queued.append(item.message)  # type: ignore[arg-type]
            elif item.lane == "draft" and self.drafts_here(item.message):
                leaving += self.draft_here(item.message)  # type: ignore[arg-type]
            else:
                leaving.append(item)
        for request_id in [r for r, d in self.drivers.items() if d.over]:
            del self.drivers[request_id]
        return leaving

    def drafts_here(self, msg: object) -> bool:
        """A draft request for a drafter this lane serves, or the end of a request it drafted for."""
        if self.local is None:
            return False
        if isinstance(msg, DraftRequest):
            return msg.drafter in self.local.sources
        return isinstance(msg, Close) and msg.request_id in self.local.active

    def draft_here(self, msg: DraftRequest | Close) -> list[Out]:
        """The proposal, made now and handed to the request's driver as the draft lane's reply would
        be, at the time it is ready (`clock`); a drafter that raises costs its step the drafts."""
        assert self.local is not None
        if isinstance(msg, Close):  # the cross-request cache learns from the request's context
            self.local.close(msg)
            return []
        try:
            with self.verifier.watch.phase(LoopPhase.DRAFTING):
                reply: Drafted | StepFailed = self.local.draft(msg)
        except Exception as exc:  # a bug costs this step its drafts, never the lane
            log.exception("drafting in the verify lane failed")
            self.local.active.pop(msg.request_id, None)
            reply = step_failed(self.lane, msg, "draft_failed", f"unexpected {exc!r}")
        driver = self.drivers.get(msg.request_id)
        if driver is None:
            return []
        return self.route(driver.on_reply(reply, self.clock()))

    def unqueue(self, request_id: str) -> None:
        self.queued = [m for m in self.queued if m.request_id != request_id]


def reports_now(out: list[Out]) -> bool:
    """Whether these messages should reach the orchestrator now rather than with the next report
    (`run.report_interval_seconds`): a request's first token and its last step are the latencies a
    client sees whole (time to first token, the end of the answer), and a failure is waited on by a
    re-prime. The steps between them lose nothing by riding the interval's bursts."""
    return any(
        isinstance(m := item.message, StepFailed) or (isinstance(m, Decided) and (m.step == 0 or m.over))
        for item in out
        if item.lane == "data"
    )
