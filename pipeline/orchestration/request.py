"""One request as the orchestrator follows it: a state machine with no I/O.

The verify lane drives the request's decode loop (`pipeline/workers/driver.py`) and sends each
decided step as a `Decided`. This machine owns what clients see: it applies each step to its own
`Session` (the same code the driver runs, `protocol.replay.apply`), so both sessions hold the same tokens and
agree on the end, turns it into chunks, and returns `effects` (the journal row, the audit event,
metrics). The hub acknowledges each journaled step to the verify lane, which never runs more than
`run.run_ahead` steps past it.

Faults only cost speed:
- a verify lane that goes down, or that stops deciding steps for `timeouts.verify`, is re-primed
  from the journaled steps once it is up (`Open` with `sample=False` and the records);
- a Decided that is lost leaves a gap in the steps, which also means a re-prime;
- a verify lane that reports the request failed ends it with an error result.
Steps already applied (repeats after a re-prime) change nothing. Each Open carries a fresh `epoch`
and the driver stamps its steps with it: steps of a driver started from an earlier Open (still in a
socket after a restart, or from a lane that was re-primed) are ignored, since that driver may have cut
the same tokens into other steps.

Every decided step leaves as a `Journaled` effect, and `replay` rebuilds a machine from those
records: a restarted orchestrator carries on from the last step any client can have seen.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import msgspec

from pipeline.decoding.decided import letters
from pipeline.decoding.result import Result
from pipeline.decoding.session import Session
from pipeline.decoding.speculation import Speculation
from pipeline.orchestration.effects import Effect, FirstToken, Journaled, Raise, Record, Send, Stepped
from pipeline.orchestration.lane_table import LaneTable
from pipeline.protocol.config import Timeouts
from pipeline.protocol.messages import Chunk, Close, Decided, Open, StepFailed, StepRecord
from pipeline.protocol.replay import apply

Reply = Decided | StepFailed


@dataclass(frozen=True)
class Identity:
    """What a request is, fixed at admission."""

    id: str
    seed: int
    speculation: Speculation
    trace: dict[str, str]
    started: float  # monotonic
    submitted: float  # wall clock, for the audit trail
    features: bool = False  # its drafter reads the target's features: the verify lane keeps them

    @property
    def drafter(self) -> str:
        return self.speculation.drafter


class RequestMachine:
    def __init__(self, who: Identity, session: Session, lanes: LaneTable, timeouts: Timeouts) -> None:
        self.who, self.session, self.lanes, self.timeouts = who, session, lanes, timeouts
        self.history: list[StepRecord] = []  # the journaled steps: what a re-prime replays
        self.chunks: list[Chunk] = []
        self.result: Result | None = None
        self.pending: Open | None = None  # the Open the verify lane was last sent
        self.deadline = math.inf  # no step decided by then: the verify lane is re-primed
        self.prefill_seconds = 0.0
        self.waiting_for_verify_lane = False

    @property
    def id(self) -> str:
        return self.who.id

    @property
    def step(self) -> int:
        """The last journaled step (0 before any: the prefill is step 0)."""
        return self.history[-1].step if self.history else 0

    @property
    def draws(self) -> int:
        """Uniforms the verifier had spent after the last journaled step."""
        return self.history[-1].draws if self.history else 0

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def pending_epoch(self) -> int | None:
        return None if self.pending is None else self.pending.epoch

    # --- inputs ------------------------------------------------------------------------

    def begin(self, now: float) -> list[Effect]:
        session = self.session
        return self._to_verify(
            Open(
                request_id=self.id, step=0, tokens=session.prompt_tokens, params=session.params,
                seed=self.who.seed, capacity=session.capacity(), trace=self.who.trace,
                features=self.who.features, speculation=self.who.speculation,
            ),
            now,
        )  # fmt: skip

    def on_reply(self, msg: Reply, now: float) -> list[Effect]:
        if self.done:
            return []
        if isinstance(msg, StepFailed):
            if msg.kind == "unknown_request":
                return self._restart(now)
            self.result = Result.failed(self.id, msg.kind, msg.message)
            return [Raise(msg.kind, "verify", msg.message, self.id), *self._release()]
        if msg.epoch != self.pending_epoch:
            return []  # decided by a driver started from an earlier Open: its steps may be cut otherwise
        expected = self.step + 1 if self.history else 0
        record = msg.record
        if record is not None and record.step > expected:
            message = f"step {record.step} came after step {expected - 1}: a step was lost; re-priming"
            return [Raise("timeout", "verify", message, self.id), *self._restart(now)]
        effects: list[Effect] = []
        if record is not None and record.step == expected:
            effects = self._decided(msg, record, now)
        elif record is not None or msg.step != self.step:
            return []  # a repeat (after a re-prime) or a stale end
        self.deadline = now + self.timeouts.verify
        if msg.over:
            effects += self._over(now)
        return effects

    def verify_lane_up(self, now: float) -> list[Effect]:
        """The verify lane is (back) up: re-prime what it lost or never got."""
        if not self.waiting_for_verify_lane or self.done:
            return []
        return self._restart(now)

    def lane_down(self, lane: str, now: float) -> list[Effect]:
        if lane == "verify" and not self.done:
            self.waiting_for_verify_lane, self.deadline = True, math.inf
        return []

    def tick(self, now: float) -> list[Effect]:
        if self.done or now < self.deadline:
            return []
        message = f"no step decided since step {self.step}; re-priming the verify lane"
        return [Raise("timeout", "verify", message, self.id), *self._restart(now)]

    def cancel(self, now: float, reason: str = "cancelled") -> list[Effect]:  # server_shutdown, storage_full
        return [] if self.done else self._finish(now, reason)

    # --- after an orchestrator restart ---------------------------------------------------

    def replay(self, records: list[StepRecord], result: Result | None) -> None:
        """Rebuild the accepted tokens, chunks and counters from the journal, exactly as the steps
        first built them (the session is a pure function of what it was fed)."""
        for record in records:
            self._apply(record)
        if result is not None:  # what `_finish` released last: text held back until the end
            released = "".join(chunk.text for chunk in self.chunks)
            self._emit(result.text[len(released) :], len(self.session.out.tokens))
            self.result = result

    def resume(self, now: float) -> list[Effect]:
        """Carry on after `replay`: re-prime the verify lane from the journaled steps (it may hold
        this request at a later step the journal never saw), or open it afresh if no token was
        decided yet; a finished request only frees the verify lane again."""
        if self.done:
            return self._release()
        return self._restart(now)

    # --- steps -------------------------------------------------------------------------

    def _to_verify(self, msg: Open, now: float) -> list[Effect]:
        msg = msgspec.structs.replace(msg, epoch=secrets.randbits(62))  # unique across orchestrator restarts
        self.pending = msg
        if not self.lanes.is_up("verify"):
            self.waiting_for_verify_lane, self.deadline = True, math.inf
            return []
        prefill = self.timeouts.prefill_per_token * (len(msg.tokens) if msg.sample else len(msg.tokens) // 4)
        self.waiting_for_verify_lane, self.deadline = False, now + self.timeouts.verify + prefill
        return [Send("verify", msg)]

    def _decided(self, msg: Decided, record: StepRecord, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if record.step == 0:  # its time, as clients see it: from admission to the first token
            record = msgspec.structs.replace(record, verify_seconds=now - self.who.started)
            effects.append(FirstToken(record.verify_seconds))
        else:
            seconds = (record.draft_seconds, record.verify_seconds)
            effects.append(Stepped(record.drafter, record.drafted, record.accepted, *seconds))
        self._apply(record)
        effects.insert(0, Journaled(record))
        if msg.event is not None:
            effects.append(Record(msg.event))
        return effects

    def _apply(self, record: StepRecord) -> None:
        """A decided step into the session and the chunks: the same code live and in `replay`."""
        before = len(self.session.out.tokens)
        text = apply(self.session, record)
        if record.step == 0:
            self.prefill_seconds = record.verify_seconds
        self.history.append(record)
        count = len(self.session.out.tokens) - before
        self._emit(text, before, letters(record.drafted, record.accepted, record.bonus, count))

    def _over(self, now: float) -> list[Effect]:
        """The verify lane found the request over: the session, fed the same steps, agrees."""
        if self.session.plan() is not None:
            message = f"the verify lane ended the request at step {self.step}, which this session would go on"
            return [Raise("verification_failed", "verify", message, self.id), *self._finish(now)]
        return self._finish(now)

    def _restart(self, now: float) -> list[Effect]:
        """The verify lane starts the request again where the journal stands: re-primed from the
        journaled steps, or opened afresh if none was journaled yet."""
        return self._reprime(now) if self.history else self.begin(now)

    def _reprime(self, now: float) -> list[Effect]:
        """Rebuild the verify lane's state for this request from the journaled steps, with the
        draw count it had, sampling nothing: its driver then stands where the last step left it."""
        session = self.session
        return self._to_verify(
            Open(
                request_id=self.id, step=self.step, tokens=session.context[:-1], params=session.params,
                seed=self.who.seed, draws=self.draws, sample=False, capacity=session.capacity(),
                prompt_length=len(session.prompt_tokens), pending=session.context[-1], trace=self.who.trace,
                features=self.who.features, speculation=self.who.speculation, history=self._replayed(),
            ),
            now,
        )  # fmt: skip

    def _replayed(self) -> list[StepRecord]:
        """The journaled steps as a re-primed driver replays them: without their logprobs, which it
        never serves (a long answer's entries would make the Open megabytes)."""
        return [msgspec.structs.replace(r, logprobs=[]) if r.logprobs else r for r in self.history]

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
        """Free the verify lane's state (best effort: it also expires idle state); its driver frees
        the drafter's."""
        self.pending, self.deadline = None, math.inf
        return [Send("verify", Close(request_id=self.id))]

    # --- output ------------------------------------------------------------------------

    def _emit(self, text: str, before: int, decided: str = "") -> None:
        tokens = self.session.out.tokens[before:]
        if text or tokens:
            self.chunks.append(Chunk(len(self.chunks), text, tokens, self.session.logprobs[before:], decided))
