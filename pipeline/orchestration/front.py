"""The client side of the orchestrator: the requests clients can poll, resume and cancel.

Chunks carry sequence numbers and stay until `timeouts.retain` after the request ends, so a
client that lost its connection resumes from the last chunk it saw. A running request that
nobody has polled for `timeouts.client_idle` (and nobody is polling now) is abandoned.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.orchestration.request import RequestMachine
from pipeline.protocol.config import Timeouts
from pipeline.protocol.messages import Chunks, ErrorReply


@dataclass
class Tracked:
    machine: RequestMachine
    last_poll: float
    pollers: int = 0  # polls waiting right now: a client in a long poll is not idle
    finished_at: float | None = None


class ClientFront:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.requests: dict[str, Tracked] = {}

    def add(self, machine: RequestMachine, now: float) -> None:
        self.requests[machine.id] = Tracked(machine, now)

    def machine(self, request_id: str) -> RequestMachine | None:
        tracked = self.requests.get(request_id)
        return tracked.machine if tracked else None

    def running(self) -> list[RequestMachine]:
        return [t.machine for t in self.requests.values() if not t.machine.done]

    def chunks(self, request_id: str, after: int) -> Chunks | ErrorReply:
        tracked = self.requests.get(request_id)
        if tracked is None:
            return ErrorReply(
                kind="unknown_request", message=f"no request {request_id!r} (finished long ago?)"
            )
        machine = tracked.machine
        return Chunks(request_id=request_id, chunks=machine.chunks[max(after + 1, 0) :], done=machine.result)

    def has_news(self, request_id: str, after: int) -> bool:
        """Whether a poll for chunks after `after` can be answered without waiting."""
        machine = self.machine(request_id)
        return machine is None or machine.done or len(machine.chunks) > after + 1

    def poll_begins(self, request_id: str) -> None:
        if request_id in self.requests:
            self.requests[request_id].pollers += 1

    def poll_ends(self, request_id: str, now: float) -> None:
        if (tracked := self.requests.get(request_id)) is not None:
            tracked.pollers -= 1
            tracked.last_poll = now

    def finished(self, request_id: str, now: float) -> None:
        self.requests[request_id].finished_at = now

    def abandoned(self, now: float) -> list[str]:
        idle = self.timeouts.client_idle
        return [
            request_id
            for request_id, t in self.requests.items()
            if not t.machine.done and not t.pollers and now - t.last_poll > idle
        ]

    def forget_expired(self, now: float) -> None:
        retain = self.timeouts.retain
        for request_id in [
            r for r, t in self.requests.items() if t.finished_at is not None and now - t.finished_at > retain
        ]:
            del self.requests[request_id]
