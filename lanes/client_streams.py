"""The orchestrator's client streams: long polls (`Poll`, `Watch`) and the gateway's pushed chunks.

A client reads a request's chunks with a long poll: `Poll` for one stream, `Watch` for all of a
watcher's (the gateway's) at once. `Wakeups` ends the polls waiting on requests with news. A `Watch`
with `push` subscribes its streams instead: their news goes onto the gateway's inbox as it is decided,
without waiting (orchestration/pushes.py), and the watch answers with news only when the inbox refused
some. Both stay in the orchestrator's event loop: the hub is not thread-safe.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import trio

from pipeline.orchestration.front import ClientFront, unknown
from pipeline.orchestration.pushes import Pushes, parts
from pipeline.protocol.messages import Chunks, Cursor, ErrorReply, Message, Poll, Watch, Watched
from pipeline.protocol.transport import Outbox


class Wakeups:
    """What wakes the long polls: a poll (`Poll`) or a watch (`Watch`, many requests at once) waits
    on an event filed under each request it asks about; `dispatch` sets those of the requests with
    news. A newer Watch of the same watcher sets the older one's, which then answers at once. The check
    for news and the filing happen with no checkpoint between them, so no wake-up falls in between."""

    def __init__(self) -> None:
        self.events: dict[str, set[trio.Event]] = {}
        self.watches: dict[str, tuple[object, trio.Event | None]] = {}  # watcher -> its newest watch

    def wake(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            for event in self.events.pop(request_id, ()):
                event.set()

    def supersede(self, watcher: str) -> object:
        """A new watch of `watcher`: the older one still waiting ends now. Its token."""
        if not watcher:
            return None
        if (older := self.watches.get(watcher)) is not None and older[1] is not None:
            older[1].set()
        token = object()
        self.watches[watcher] = (token, None)
        return token

    def current(self, watcher: str, token: object) -> bool:
        return not watcher or self.watches.get(watcher, (None,))[0] is token

    def done(self, watcher: str, token: object) -> None:
        if watcher and self.current(watcher, token):
            del self.watches[watcher]

    async def until(
        self, request_ids: list[str], ready: Any, watcher: str = "", token: object = None
    ) -> None:
        """Until `ready()`, or a newer watch of `watcher` than `token`'s (the caller bounds it in time)."""
        while not ready() and self.current(watcher, token):
            event = trio.Event()
            for request_id in request_ids:
                self.events.setdefault(request_id, set()).add(event)
            if watcher:
                self.watches[watcher] = (token, event)
            try:
                await event.wait()
            finally:
                for request_id in request_ids:
                    if (events := self.events.get(request_id)) is not None:
                        events.discard(event)
                        if not events:
                            del self.events[request_id]


class ClientStreams:
    def __init__(
        self, front: ClientFront, gateway: Outbox | None, poll_wait_max: float, max_message_bytes: int
    ) -> None:
        """`gateway`: the gateway's inbox, or None where no gateway runs (a push watch is then plain);
        it takes messages of up to `max_message_bytes`."""
        self.front, self.gateway, self.poll_wait_max = front, gateway, poll_wait_max
        self.max_message_bytes = max_message_bytes
        self.wakeups = Wakeups()
        self.pushes = Pushes()  # the gateway's streams (`Watch.push`)

    def news(self, request_ids: set[str]) -> None:
        """These requests have new chunks or their end: pushed first, then the polls woken (a push
        watch answers with what its inbox refused)."""
        self.push(request_ids)
        self.wakeups.wake(request_ids)

    def push(self, request_ids: Iterable[str]) -> None:
        """The news of the gateway's subscribed streams among `request_ids`, onto its inbox in one
        message (or a few, by size), without waiting. The first it refuses blocks pushing until the
        gateway watches again; its watch, woken with the others, answers with the news meanwhile
        (orchestration/pushes.py)."""
        if self.gateway is None or self.pushes.blocked:
            return
        streams = self.pushes.news(self.front, request_ids)
        for part, data in parts(self.pushes.watcher, streams, self.max_message_bytes) if streams else ():
            if not self.gateway.put_bytes_nowait(data):
                self.pushes.blocked = True
                return
            self.pushes.pushed(part)

    def poll_wait(self, kind: str, wait: float) -> float | ErrorReply:
        """A long poll's wait, bounded to [0, timeouts.poll_wait_max]. NaN is a bad request: trio
        refuses a NaN timeout, which was an "internal" error (test_hostile)."""
        if math.isnan(wait):
            return ErrorReply(kind="bad_request", message=f"{kind}.wait must be a number of seconds, got NaN")
        return min(max(wait, 0.0), self.poll_wait_max)

    async def poll(self, msg: Poll) -> Message:
        front, request_id = self.front, msg.request_id
        if front.owned(request_id, msg.secret) is None:
            return unknown(request_id)
        wait = self.poll_wait("Poll", msg.wait)
        if isinstance(wait, ErrorReply):
            return wait
        await self.polled([request_id], wait, lambda: front.has_news(request_id, msg.after))
        return front.chunks(request_id, msg.after, msg.secret)

    async def polled(
        self, ids: list[str], wait: float, ready: Any, watcher: str = "", token: object = None
    ) -> None:
        """Until `ready()`, for at most `wait` seconds; meanwhile the requests count as read by a
        client (a request nobody reads for `timeouts.client_idle` is cancelled)."""
        front = self.front
        for request_id in ids:
            front.poll_begins(request_id)
        try:
            with trio.move_on_after(wait):
                await self.wakeups.until(ids, ready, watcher, token)
        finally:
            for request_id in ids:
                front.poll_ends(request_id, trio.current_time())

    async def watch(self, msg: Watch) -> Message:
        """Every stream of a watcher (the gateway) in one long poll: the reply carries the news of all
        that have some, so N streams cost one round trip per burst of steps, not N. With `push`, the
        news goes onto the gateway's inbox instead (`push`), and the reply only when it cannot."""
        front = self.front
        wait = self.poll_wait("Watch", msg.wait)
        if isinstance(wait, ErrorReply):
            return wait
        cursors = [c for c in msg.cursors if front.owned(c.request_id, c.secret) is not None]
        ids = [c.request_id for c in cursors]
        token = self.wakeups.supersede(msg.watcher)
        known = len(cursors) == len(msg.cursors)  # an unknown stream is news: answered at once
        pushing = known and msg.push and self.gateway is not None
        if known:
            ready = functools.partial(any_news, front, cursors)
            if pushing:
                self.pushes.subscribe(msg.watcher, cursors)
                self.push(ids)
                ready = functools.partial(self.pushes_blocked, ready)
            await self.polled(ids, wait, ready, msg.watcher, token)
        self.wakeups.done(msg.watcher, token)
        if pushing and not self.pushes.blocked:
            return Watched(streams=[])  # everything went (or goes) onto the gateway's inbox
        news: list[Chunks] = []
        unknown_ids: list[str] = []
        for c in msg.cursors:
            if front.has_news(c.request_id, c.after):  # so has one unknown (or forgotten since): an error
                reply = front.chunks(c.request_id, c.after, c.secret)
                news.append(reply) if isinstance(reply, Chunks) else unknown_ids.append(c.request_id)
        return Watched(streams=news, unknown=unknown_ids)

    def pushes_blocked(self, news: Any) -> bool:
        """When a push watch answers: its streams have news that the gateway's inbox refused."""
        return self.pushes.blocked and news()


def any_news(front: ClientFront, cursors: list[Cursor]) -> bool:
    return any(front.has_news(c.request_id, c.after) for c in cursors)
