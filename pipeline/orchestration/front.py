"""The client side of the orchestrator: the requests clients can poll, resume and cancel.

Chunks carry sequence numbers and stay until `timeouts.retain` after the request ends, so a
client that lost its connection resumes from the last chunk it saw. A running request that
nobody has polled for `timeouts.client_idle` (and nobody is polling now) is abandoned.

A request belongs to whoever submitted it: reading and cancelling it take the secret its
Submit was answered with. A wrong secret gets the same answer as an unknown id, so request
ids (which `status` shows in faults) tell nobody else anything.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from pipeline.orchestration.request import RequestMachine
from pipeline.protocol.config import Timeouts
from pipeline.protocol.messages import Chunks, ErrorReply, Submitted


@dataclass
class Tracked:
    machine: RequestMachine
    last_poll: float
    secret: str
    owner: str = ""
    pollers: int = 0  # polls waiting right now: a client in a long poll is not idle
    finished_at: float | None = None


class ClientFront:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.requests: dict[str, Tracked] = {}
        self.by_key: dict[str, str] = {}  # idempotency key -> request id

    def add(self, machine: RequestMachine, now: float, secret: str, owner: str = "", key: str = "") -> None:
        self.requests[machine.id] = Tracked(machine, now, secret, owner)
        if key:
            self.by_key[key] = machine.id

    def repeated(self, key: str) -> Submitted | None:
        """The answer to a Submit repeated with this idempotency key (the first reply was lost)."""
        tracked = self.requests.get(self.by_key.get(key, "")) if key else None
        if tracked is None:
            return None
        machine = tracked.machine
        return Submitted(
            request_id=machine.id, prompt_tokens=len(machine.session.prompt_tokens), secret=tracked.secret
        )

    def taken(self, request_id: str) -> ErrorReply | None:
        """A Submit that asks for an id (a choice's) another request here has."""
        if request_id and request_id in self.requests:
            return ErrorReply(kind="bad_request", message=f"request id {request_id!r} is taken")
        return None

    def machine(self, request_id: str) -> RequestMachine | None:
        tracked = self.requests.get(request_id)
        return tracked.machine if tracked else None

    def owned(self, request_id: str, secret: str) -> RequestMachine | None:
        """The request, if `secret` is its own (compared in constant time)."""
        tracked = self.requests.get(request_id)
        if tracked is None or not hmac.compare_digest(tracked.secret.encode(), secret.encode()):
            return None
        return tracked.machine

    def owned_by(self, owner: str) -> list[RequestMachine]:
        return [t.machine for t in self.requests.values() if t.owner == owner and not t.machine.done]

    def orphaned(self, lane: str, pid: int | None) -> list[RequestMachine]:
        """Unfinished requests owned by another process of `lane` than `pid`, now that `pid` is up:
        a lane runs one process at a time, so theirs is gone (after a supervisor's restart no
        LaneDown ever said so; their clients went with it)."""
        prefix = f"{lane}:"
        return [
            t.machine for t in self.requests.values()
            if t.owner.startswith(prefix) and t.owner != f"{lane}:{pid}" and not t.machine.done
        ]  # fmt: skip

    def running(self) -> list[RequestMachine]:
        return [t.machine for t in self.requests.values() if not t.machine.done]

    def chunks(self, request_id: str, after: int, secret: str) -> Chunks | ErrorReply:
        machine = self.owned(request_id, secret)
        if machine is None:
            return unknown(request_id)
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

    def abandoned(self, now: float) -> list[RequestMachine]:
        idle = self.timeouts.client_idle
        return [
            t.machine
            for t in self.requests.values()
            if not t.machine.done and not t.pollers and now - t.last_poll > idle
        ]

    def forget_expired(self, now: float, keep_at_most: int) -> list[str]:
        """Finished requests past their retention, and the oldest finished ones beyond
        `keep_at_most`: the ids forgotten."""
        retain = self.timeouts.retain
        finished = [(t.finished_at, r) for r, t in self.requests.items() if t.finished_at is not None]
        expired = [r for at, r in finished if now - at > retain]
        if len(finished) - len(expired) > keep_at_most:  # over the cap: sorted only then (a tick is hot)
            kept = sorted((at, r) for at, r in finished if now - at <= retain)
            expired += [r for _, r in kept[: len(kept) - keep_at_most]]
        for request_id in expired:
            del self.requests[request_id]
        if expired:
            self.by_key = {key: r for key, r in self.by_key.items() if r in self.requests}
        return expired


def unknown(request_id: str) -> ErrorReply:
    """For an id that is not known here, or not the caller's to see."""
    return ErrorReply(kind="unknown_request", message=f"no request {request_id!r} (finished long ago?)")
