"""Which admitted requests decode now and which wait their turn.

At most `admission.max_running` requests decode at once: each holds a KV cache in the verify
lane and a share of every batched forward, so an unbounded number would exhaust memory and
slow every stream alike. Up to `admission.max_queued` more wait, admitted (tokenized, known
to clients, cancellable) but not yet begun, and begin in arrival order as running ones end.
Beyond that a new request is refused at once (overloaded) instead of waiting without bound.
It only counts request ids; the hub begins and ends the requests themselves.
"""

from __future__ import annotations

import collections

from pipeline.protocol.config import Admission
from pipeline.protocol.messages import ErrorReply


class AdmissionQueue:
    def __init__(self, limits: Admission) -> None:
        self.limits = limits
        self.running: set[str] = set()
        self.waiting: collections.deque[str] = collections.deque()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    def refusal(self) -> ErrorReply | None:
        """Why one more request cannot be taken now, or None when it can (to run or to wait)."""
        limits = self.limits
        if len(self.running) < limits.max_running or len(self.waiting) < limits.max_queued:
            return None
        return ErrorReply(
            kind="overloaded",
            message=(
                f"the pipeline is at capacity ({len(self.running)} requests running, {len(self.waiting)} "
                f"waiting: admission.max_running = {limits.max_running}, max_queued = {limits.max_queued}); "
                "try again shortly"
            ),
        )

    def enter(self, request_id: str) -> bool:
        """True: it may begin now; False: it waits its turn. Call only when `refusal()` is None."""
        if len(self.running) < self.limits.max_running:
            self.running.add(request_id)
            return True
        self.waiting.append(request_id)
        return False

    def leave(self, request_id: str) -> list[str]:
        """The request ended (finished, failed or cancelled, running or still waiting); returns the
        waiting requests that may begin now, oldest first."""
        self.running.discard(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        ready = []
        while self.waiting and len(self.running) < self.limits.max_running:
            ready.append(self.waiting.popleft())
            self.running.add(ready[-1])
        return ready
