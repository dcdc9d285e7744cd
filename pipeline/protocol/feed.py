"""All of one client's streams read through one long poll (`Feed`, the gateway's `AsyncClient`'s).

Each stream's reader waits for its own chunks. Whichever reader finds no `Watch` in flight sends one,
over every stream with room for more, and hands the reply's news to every stream it concerns; the
others wait for that round to end. So N streams cost the orchestrator one round trip per burst of
decided steps, not N, and nothing runs in the background: a feed with no reader sends nothing.

- **A stream that joins** while a watch is in flight without it cancels that call; the next watch
  asks about it too, and the orchestrator answers the older one at once (`Watch.watcher`).
- **Exactly once, in order.** A stream's cursor moves only over the chunks a reply brought in order
  (`continuation`: repeats dropped). A reply that never comes (a cancelled call, an orchestrator that
  restarted, whose replies the client retries) only means the same chunks are asked for again.
- **Bounded.** A stream holds at most `MAX_HELD` chunks its reader has not taken; past that it is
  left out of the watches (the orchestrator keeps its chunks, as it does for any resuming client)
  until the reader catches up. A reader takes everything held at once, so a reader slower than the
  tokens gets them coalesced (`merged`), never an unbounded queue.
- **Errors.** A call that fails (the orchestrator unreachable past the timeout) ends every stream it
  asked about with that error; a stream the orchestrator does not know ends with `unknown_request`.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from pipeline.decoding.result import Result
from pipeline.protocol.messages import Chunk, Chunks, Cursor, Watch, Watched

MAX_HELD = 64  # chunks a stream holds for a reader that has not taken them (each a step's tokens)
WATCH_SECONDS = 5.0  # how long one watch waits for news before it is sent again


async def until_done(take: Callable[[], Awaitable[list[Chunk | Result]]]) -> AsyncIterator[list[Any]]:
    """`take()`'s batches, up to the one that ends with the final `Result`."""
    while True:
        batch = await take()
        yield batch
        if isinstance(batch[-1], Result):
            return


def continuation(reply: Chunks, after: int) -> tuple[list[Chunk], int, Result | None]:
    """The chunks that follow `after` (repeats dropped), the new `after`, and the final object
    once nothing before it is missing."""
    fresh = []
    for chunk in reply.chunks:
        if chunk.seq == after + 1:
            after = chunk.seq
            fresh.append(chunk)
    complete = reply.done is not None and (not reply.chunks or reply.chunks[-1].seq == after)
    return fresh, after, reply.done if complete else None


def merged(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks as one (the last one's seq): what a reader that fell behind is shown."""
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        chunks[-1].seq,
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.tokens],
        [entry for c in chunks for entry in c.logprobs],
        "".join(c.decided for c in chunks),
    )


@dataclass
class Stream:
    request_id: str
    secret: str
    after: int = -1
    held: list[Chunk] = field(default_factory=list)
    done: Result | None = None
    error: BaseException | None = None

    def ready(self) -> bool:
        return bool(self.held) or self.done is not None or self.error is not None

    def wants(self) -> bool:
        return len(self.held) < MAX_HELD and self.done is None and self.error is None

    def take(self) -> list[Chunk | Result]:
        if self.error is not None and not self.held:
            raise self.error
        items: list[Chunk | Result] = [*self.held]
        self.held = []
        if self.done is not None and self.error is None:
            items.append(self.done)
        return items


Call = Callable[[Watch, float], Awaitable[Watched]]
Error = Callable[[str, str], Exception]  # (kind, message): the client's error type


class Feed:
    def __init__(self, call: Call, error: type[Exception], wait: float = WATCH_SECONDS) -> None:
        """`call(watch, wait)`: the client's request/reply, retried across an orchestrator restart; it
        raises `error` (built from a kind and a message) when the orchestrator cannot be reached."""
        self.call, self.error, self.wait = call, error, wait
        self.watcher = uuid.uuid4().hex
        self.streams: dict[int, Stream] = {}
        self.keys = itertools.count()
        self.watching: set[int] | None = None  # the streams the watch in flight asks about
        self.scope: trio.CancelScope | None = None
        self.round = trio.Event()  # set when a watch ends, however it ended

    async def items(self, request_id: str, secret: str, after: int = -1) -> AsyncIterator[list[Any]]:
        """The stream's chunks after `after` in batches (what arrived since the reader last took),
        the final `Result` last."""
        key = next(self.keys)
        stream = self.streams[key] = Stream(request_id, secret, after)
        try:
            async for batch in until_done(functools.partial(self.take, key, stream)):
                yield batch
        finally:
            del self.streams[key]

    async def take(self, key: int, stream: Stream) -> list[Chunk | Result]:
        while not stream.ready():
            if self.watching is None:
                await self.lead()
                continue
            if key not in self.watching and self.scope is not None:
                self.scope.cancel()  # the watch in flight does not ask about this stream: ask again
            await self.round.wait()
        return stream.take()

    async def lead(self) -> None:
        """One watch over every stream that wants more, its news handed out."""
        wanted = {key: s for key, s in self.streams.items() if s.wants()}
        cursors = [Cursor(s.request_id, s.secret, s.after) for s in wanted.values()]
        self.watching = set(wanted)
        try:
            with trio.CancelScope() as self.scope:
                reply = await self.call(
                    Watch(watcher=self.watcher, cursors=cursors, wait=self.wait), self.wait
                )
                deliver(wanted.values(), reply, self.error)  # no checkpoint between the reply and this
        except self.error as exc:
            for stream in wanted.values():
                stream.error = exc
        finally:
            self.watching, self.scope = None, None
            self.round.set()
            self.round = trio.Event()


def deliver(streams: Any, reply: Watched, error: Error) -> None:
    news = {chunks.request_id: chunks for chunks in reply.streams}
    unknown = set(reply.unknown)
    for stream in streams:
        if stream.request_id in unknown:
            message = f"no request {stream.request_id!r} (finished long ago?)"
            stream.error = error("unknown_request", message)
        elif (chunks := news.get(stream.request_id)) is not None:
            fresh, stream.after, done = continuation(chunks, stream.after)
            stream.held += fresh
            stream.done = done or stream.done
