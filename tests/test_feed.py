"""One long poll for all of a client's streams (pipeline/protocol/feed.py) against a stand-in for the
orchestrator that waits with the orchestrator's own `Wakeups` (lanes/client_streams.py): every stream
gets its chunks once and in order, N streams cost one watch per burst, a stream that joins is not
held up behind a watch that does not ask about it, a slow reader is held to a bound and gets the rest
coalesced, and errors end the streams they concern."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from lanes.client_streams import Wakeups
from pipeline.decoding.result import Result
from pipeline.protocol.client import PipelineError
from pipeline.protocol.feed import MAX_HELD, Feed, merged
from pipeline.protocol.messages import Chunk, Chunks, Cursor, Watch, Watched
from pipeline.protocol.push_feed import PushFeed


def result(request_id: str, tokens: list[int]) -> Result:
    return msgspec.convert(
        {
            "request_id": request_id,
            "prompt_tokens": [1],
            "tokens": tokens,
            "text": "",
            "finish_reason": "stop",
            "stats": {},
        },
        Result,
    )


class Orchestrator:
    """Requests whose chunks the test adds; `call` answers a Watch as lanes/orchestrator.py does."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[Chunk]] = {}
        self.done: dict[str, Result] = {}
        self.wakeups = Wakeups()
        self.watches: list[Watch] = []
        self.fail: PipelineError | None = None

    def add(self, request_id: str, count: int = 1) -> None:
        chunks = self.chunks.setdefault(request_id, [])
        for _ in range(count):
            seq = len(chunks)
            chunks.append(Chunk(seq, f"<{request_id}{seq}>", [seq]))
        self.wakeups.wake({request_id})

    def finish(self, request_id: str) -> None:
        self.done[request_id] = result(request_id, [c.tokens[0] for c in self.chunks[request_id]])
        self.wakeups.wake({request_id})

    def news(self, c: Cursor) -> bool:
        return (
            c.request_id not in self.chunks
            or len(self.chunks[c.request_id]) > c.after + 1
            or (c.request_id in self.done)
        )

    async def call(self, watch: Watch, wait: float) -> Watched:
        self.watches.append(watch)
        if self.fail is not None:
            raise self.fail
        token = self.wakeups.supersede(watch.watcher)
        known = [c for c in watch.cursors if c.request_id in self.chunks]
        if len(known) == len(watch.cursors):
            with trio.move_on_after(watch.wait):
                ready = lambda: any(self.news(c) for c in known)  # noqa: E731
                await self.wakeups.until([c.request_id for c in known], ready, watch.watcher, token)
        self.wakeups.done(watch.watcher, token)
        streams = [
            Chunks(
                request_id=c.request_id, chunks=self.chunks[c.request_id][c.after + 1 :],
                done=self.done.get(c.request_id),
            )
            for c in known if self.news(c)
        ]  # fmt: skip
        unknown = [c.request_id for c in watch.cursors if c.request_id not in self.chunks]
        return Watched(streams=streams, unknown=unknown)


async def read(
    feed: Feed | PushFeed,
    request_id: str,
    got: dict[str, list],
    pause: float = 0.0,
    batches: list | None = None,
) -> None:
    got[request_id] = []
    async for batch in feed.items(request_id, "secret"):
        got[request_id] += batch
        if batches is not None:
            batches.append(batch)
        await trio.sleep(pause)


def texts(items: list) -> str:
    return "".join(item.text for item in items if isinstance(item, Chunk))


def expected(request_id: str, count: int) -> str:
    """The text of `count` chunks the stand-ins' `add` made."""
    return "".join(f"<{request_id}{seq}>" for seq in range(count))


async def slow_and_fast(orchestrator: Any, feed: Any, held: list[int]) -> None:
    """300 chunks each of "slow" and "fast", 0.1 s apart, then both ends; after each step, `held`
    gets the most chunks any stream of `feed` holds."""
    for _ in range(300):
        orchestrator.add("slow")
        orchestrator.add("fast")
        await trio.sleep(0.1)
        held.append(max(len(s.held) for s in feed.streams.values()))
    orchestrator.finish("slow")
    orchestrator.finish("fast")


async def bursts(orchestrator: Any, ids: list[str], count: int = 20) -> None:
    """`count` bursts a second apart, each a step of 2 chunks for every request at once."""
    for _ in range(count):
        for request_id in ids:
            orchestrator.add(request_id, 2)
        await trio.sleep(1)


def test_every_stream_gets_its_chunks_once_in_order_from_one_watch_per_burst():
    orchestrator, got = Orchestrator(), {}
    ids = ["a", "b", "c"]

    async def main() -> None:
        feed = Feed(orchestrator.call, PipelineError)
        for request_id in ids:
            orchestrator.chunks[request_id] = []
        async with trio.open_nursery() as nursery:
            for request_id in ids:
                nursery.start_soon(read, feed, request_id, got)
            await trio.sleep(1)
            joined = len(orchestrator.watches)
            await bursts(orchestrator, ids)
            watches = len(orchestrator.watches) - joined
            for request_id in ids:
                orchestrator.finish(request_id)
        assert watches <= 21, watches  # one watch a burst for all three streams, not three

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for request_id in ids:
        assert texts(got[request_id]) == expected(request_id, 40)
        assert got[request_id][-1] == orchestrator.done[request_id]


def test_a_stream_that_joins_is_not_held_up_behind_a_watch_without_it():
    orchestrator, got = Orchestrator(), {}

    async def main() -> None:
        feed = Feed(orchestrator.call, PipelineError, wait=60.0)
        orchestrator.chunks["idle"], orchestrator.chunks["new"] = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, feed, "idle", got)
            await trio.sleep(1)  # a watch now waits on "idle" alone, for up to 60 s
            orchestrator.add("new")
            start = trio.current_time()
            nursery.start_soon(read, feed, "new", got)
            while not got.get("new"):
                await trio.sleep(0.01)
            assert trio.current_time() - start < 1.0
            assert orchestrator.watches[-1].cursors[-1].request_id == "new"
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert texts(got["new"]) == "<new0>"


def test_a_slow_reader_is_held_to_a_bound_and_gets_the_rest_coalesced_in_order():
    orchestrator, got = Orchestrator(), {}
    held: list[int] = []
    batches: list[list] = []

    async def main() -> None:
        feed = Feed(orchestrator.call, PipelineError)
        orchestrator.chunks["slow"], orchestrator.chunks["fast"] = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, feed, "slow", got, 50.0, batches)  # takes a batch every 50 s
            nursery.start_soon(read, feed, "fast", got)
            await slow_and_fast(orchestrator, feed, held)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert max(held) <= MAX_HELD
    for request_id in ("slow", "fast"):
        assert texts(got[request_id]) == expected(request_id, 300)
    assert len(batches) < 20  # coalesced: a few batches (one chunk each through the client), not 300


async def read_to_error(feed: Feed | PushFeed, request_id: str, errors: dict[str, str]) -> None:
    """Reads the stream, which must end with an error: its kind goes into `errors`."""
    with pytest.raises(PipelineError) as caught:
        async for _ in feed.items(request_id, "secret"):
            pass
    errors[request_id] = caught.value.kind


def test_errors_end_the_streams_they_concern():
    orchestrator, errors = Orchestrator(), {}
    reader = functools.partial(read_to_error, errors=errors)

    async def main() -> None:
        feed = Feed(orchestrator.call, PipelineError)
        orchestrator.chunks["known"] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, feed, "gone")  # the orchestrator does not know it
            await trio.sleep(1)
            assert errors == {"gone": "unknown_request"}
            nursery.start_soon(reader, feed, "known")
            await trio.sleep(1)
            orchestrator.fail = PipelineError("unavailable", "no answer")
            orchestrator.add("known")  # the watch in flight answers; the next call fails

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert errors == {"gone": "unknown_request", "known": "unavailable"}


def test_merged_chunks_keep_every_token_and_the_last_seq():
    chunks = [Chunk(3, "a", [1], [], "p"), Chunk(4, "bc", [2, 3], [], "ac")]
    assert merged(chunks) == Chunk(4, "abc", [1, 2, 3], [], "pac")
    assert merged(chunks[:1]) is chunks[0]
