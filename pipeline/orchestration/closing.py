"""The pipeline's shutdown, as the orchestrator keeps it (I/O-free, driven by the hub).

The supervisor's `Shutdown` notice closes admission at once: every new request is refused as
`draining` (HTTP 503 with Retry-After). With a drain window, what is in flight may finish within
it; when it closes, the hub ends the rest with the finish reason `server_shutdown`, which their
clients receive (SSE: an error event and [DONE]) and the journal records as finished, so no
later start resumes them. Without a window the supervisor stops the processes at once, and the
next start resumes what was in flight (SIGINT, `speclanes stop --now`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from pipeline.orchestration.effects import Send
from pipeline.protocol.messages import ErrorReply, Shutdown

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class Closing:
    reason: str = ""  # why nothing new is admitted ("": the pipeline is open)
    drain_until: float | None = None
    ended: int = 0  # requests the window's end ended unfinished

    def notice(self, msg: Shutdown, now: float, unfinished: int) -> list[Send]:
        """Admission closes; the drain window, if any, opens. Nothing to send."""
        self.reason = msg.reason or "shutdown"
        if msg.drain_seconds > 0 and self.drain_until is None:
            self.drain_until = now + msg.drain_seconds
            log.info("draining: %d requests have %g s to finish", unfinished, msg.drain_seconds)
        return []

    def refusal(self) -> ErrorReply | None:
        if not self.reason:
            return None
        return ErrorReply(kind="draining", message=f"the pipeline is shutting down ({self.reason})")

    def to_end(self, now: float, unfinished: Sequence[T]) -> Sequence[T]:
        """Once the drain window is over, the `unfinished` requests (once): the hub ends them."""
        if self.drain_until is None or now < self.drain_until:
            return ()
        self.drain_until, self.ended = None, self.ended + len(unfinished)
        if unfinished:
            log.warning("drain window over: ending %d unfinished requests", len(unfinished))
        return unfinished

    def fields(self) -> dict[str, str | int]:
        """What the status report says of it."""
        return {"closing": self.reason, "ended_at_shutdown": self.ended}
