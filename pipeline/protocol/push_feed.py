"""All of the gateway's streams, their chunks pushed onto its inbox (`PushFeed`; `Watch.push`, `Pushed`).

`Feed` asks for chunks with one long poll per burst of decided steps, and each poll wakes the
orchestrator twice (the request arriving, its reply's send completing) on the cores the forward uses.
Here one watch subscribes every stream with room for more, and the orchestrator pushes each stream's
chunks onto the gateway's inbox as it decides them (orchestration/pushes.py). The watch is answered
after `wait` seconds and then sent again, which renews the subscription (an orchestrator that restarted
has forgotten it), or sooner when a newer watch supersedes it, or with the news its pushes could not
deliver (the inbox refused one). An orchestrator that cannot push answers it as a plain watch, so the
feed then works as `Feed` does.

- **The set changes** (a stream joins, or one fills up or has room again): the watch is sent again with
  the new set (`renew`).
- **Exactly once, in order.** The orchestrator pushes in order, and a push is lost only with the pipe
  it was on. So when a pipe of the inbox closes, the watch is sent again from where each stream really
  is, which resets the orchestrator's cursors. A push that does not follow its stream's cursor
  (`Pushed.after` past it) is dropped, and the watch is sent again the same way; repeats are dropped
  (`continuation`).
- **Bounded.** As in `Feed`: a stream holding `MAX_HELD` chunks its reader has not taken is left out of
  the watch, and pushes for it are dropped until the reader catches up.
- **Errors.** As in `Feed`: a watch that fails ends every stream it asked about, and an unknown stream
  ends with `unknown_request`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import trio

from pipeline.decoding.result import Result
from pipeline.protocol.feed import WATCH_SECONDS, Call, Stream, continuation, deliver, until_done
from pipeline.protocol.messages import BadMessage, Chunk, Cursor, Pushed, Watch

log = logging.getLogger(__name__)


class Receiver(Protocol):
    """The gateway's inbox (transport.Inbox), as the feed reads it."""

    async def next(self) -> Pushed | BadMessage: ...

    def ready(self) -> list[Pushed | BadMessage]: ...

    def on_pipe_closed(self, callback: Callable[[], object]) -> None: ...


class PushFeed:
    def __init__(
        self, call: Call, error: type[Exception], inbox: Receiver, wait: float = WATCH_SECONDS
    ) -> None:
        """`call(watch, wait)`: the client's request/reply, retried across an orchestrator restart; it
        raises `error` when the orchestrator cannot be reached. `run` must be running for anything
        to arrive."""
        self.call, self.error, self.inbox, self.wait = call, error, inbox, wait
        self.watcher = uuid.uuid4().hex
        self.streams: dict[int, Stream] = {}
        self.arrived: dict[int, trio.Event] = {}  # set when a stream's reader has something to take
        self.keys = itertools.count()
        self.watching: set[int] = set()  # the streams the current subscription covers
        self.scope: trio.CancelScope | None = None  # the watch in flight
        self.again = trio.Event()  # set when the watch must be sent again

    async def items(self, request_id: str, secret: str, after: int = -1) -> AsyncIterator[list[Any]]:
        """As `Feed.items`: the stream's chunks after `after` in batches, the final `Result` last."""
        key = next(self.keys)
        stream = self.streams[key] = Stream(request_id, secret, after)
        self.arrived[key] = trio.Event()
        self.renew()
        try:
            async for batch in until_done(functools.partial(self.take, key, stream)):
                yield batch
        finally:
            del self.streams[key], self.arrived[key]

    async def take(self, key: int, stream: Stream) -> list[Chunk | Result]:
        while not stream.ready():
            if key not in self.watching:
                self.renew()  # it joined, or had been left out while full: ask for it
            self.arrived[key] = event = trio.Event()
            await event.wait()
        return stream.take()

    def renew(self) -> None:
        """The watch goes again, with the streams that want more now."""
        if self.scope is not None:
            self.scope.cancel()
        self.again.set()

    async def run(self) -> None:
        """The feed's two tasks: the subscription, and the inbox."""
        self.inbox.on_pipe_closed(self.renew)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.subscribe)
            nursery.start_soon(self.receive)

    async def subscribe(self) -> None:
        while True:
            wanted = {key: s for key, s in self.streams.items() if s.wants()}
            self.watching = set(wanted)
            if not wanted:
                await self.again.wait()
            self.again = trio.Event()
            if not wanted:
                continue
            cursors = [Cursor(s.request_id, s.secret, s.after) for s in wanted.values()]
            watch = Watch(watcher=self.watcher, cursors=cursors, wait=self.wait, push=True)
            try:
                with trio.CancelScope() as self.scope:
                    deliver(wanted.values(), await self.call(watch, self.wait), self.error)
            except self.error as exc:
                for stream in wanted.values():
                    stream.error = exc
            finally:
                self.scope = None
                self.wake(wanted)

    async def receive(self) -> None:
        while True:
            for message in [await self.inbox.next(), *self.inbox.ready()]:
                if isinstance(message, BadMessage):
                    log.warning("the gateway inbox got a bad message: %s", message)
                elif message.watcher == self.watcher:  # not one meant for a gateway before a restart
                    self.accept(message)

    def accept(self, message: Pushed) -> None:
        """Each pushed stream into every stream of its request that follows on from it."""
        pushed = {p.chunks.request_id: p for p in message.streams}
        touched = {}
        for key, stream in self.streams.items():
            if (push := pushed.get(stream.request_id)) is None or stream.done or stream.error:
                continue
            if not stream.wants() or push.after > stream.after:
                self.renew()  # full (leave it out of the watch), or a push was lost: watch from its cursor
                continue
            fresh, stream.after, done = continuation(push.chunks, stream.after)
            stream.held += fresh
            stream.done = done or stream.done
            touched[key] = stream
        self.wake(touched)

    def wake(self, streams: dict[int, Stream]) -> None:
        for key, stream in streams.items():
            if stream.ready() and key in self.arrived:
                self.arrived[key].set()
