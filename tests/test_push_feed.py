"""The gateway's streams with their chunks pushed (pipeline/protocol/push_feed.py) against the
orchestrator's own side (`ClientStreams`, lanes/client_streams.py, and orchestration/pushes.py) over a
stand-in inbox that can lose, refuse and repeat: every stream gets its chunks once and in order, with a
watch per change of the set and not per burst; a lost push is repaired, a refused one goes by the watch
instead; a slow reader is held to a bound; errors end the streams they concern."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings

from lanes.client_streams import ClientStreams
from pipeline.decoding.result import Result
from pipeline.orchestration.front import unknown
from pipeline.orchestration.pushes import parts
from pipeline.protocol.client import PipelineError
from pipeline.protocol.feed import MAX_HELD
from pipeline.protocol.messages import (
    BadMessage,
    Chunk,
    Chunks,
    Codec,
    ErrorReply,
    GatewayInbox,
    Pushed,
    PushedStream,
    Watch,
    Watched,
)
from pipeline.protocol.push_feed import PushFeed

from .test_feed import bursts, expected, read, read_to_error, slow_and_fast, texts


def result(request_id: str, count: int) -> Result:
    fields = {"request_id": request_id, "prompt_tokens": [1], "tokens": list(range(count))}
    return msgspec.convert({**fields, "text": "", "finish_reason": "stop", "stats": {}}, Result)


class Front:
    """What `ClientStreams` reads of the orchestrator's ClientFront, over chunks the test decides."""

    def __init__(self) -> None:
        self.decided: dict[str, list[Chunk]] = {}
        self.results: dict[str, Result] = {}
        self.pollers: collections.Counter[str] = collections.Counter()

    def owned(self, request_id: str, secret: str) -> bool | None:
        return True if request_id in self.decided else None

    def has_news(self, request_id: str, after: int) -> bool:
        decided = self.decided.get(request_id)
        return decided is None or request_id in self.results or len(decided) > after + 1

    def chunks(self, request_id: str, after: int, secret: str) -> Chunks | ErrorReply:
        if request_id not in self.decided:
            return unknown(request_id)
        fresh = self.decided[request_id][max(after + 1, 0) :]
        return Chunks(request_id=request_id, chunks=fresh, done=self.results.get(request_id))

    def poll_begins(self, request_id: str) -> None:
        self.pollers[request_id] += 1

    def poll_ends(self, request_id: str, now: float) -> None:
        self.pollers[request_id] -= 1


class Inbox:
    """The gateway's inbox as both ends see it: the orchestrator's `put_nowait`, the feed's `next`,
    `ready` and `on_pipe_closed`. `held`: pushes stay in flight; `lose()`: the pipe closes, and what was
    in flight with it; `refuse`: it takes none; `repeat`: it delivers each twice."""

    def __init__(self) -> None:
        self.queue: collections.deque[Pushed] = collections.deque()
        self.arrived = trio.Event()
        self.held, self.refuse, self.repeat = False, False, False
        self.closed: list[Callable[[], object]] = []
        self.codec: Codec[Pushed] = Codec(GatewayInbox)
        self.sizes: list[int] = []  # of each message taken

    def on_pipe_closed(self, callback: Callable[[], object]) -> None:
        self.closed.append(callback)

    def lose(self) -> None:
        self.queue.clear()
        self.release()
        for callback in self.closed:  # as nng tells it: later, from its own thread
            trio.lowlevel.current_trio_token().run_sync_soon(callback)

    def release(self) -> None:
        self.held = False
        self.arrived.set()

    def put_bytes_nowait(self, data: bytes) -> bool:
        if self.refuse:
            return False
        message = self.codec.decode(data)
        self.sizes.append(len(data))
        self.queue.extend([message, message] if self.repeat else [message])
        self.arrived.set()
        return True

    async def next(self) -> Pushed | BadMessage:
        while self.held or not self.queue:
            self.arrived = trio.Event()
            await self.arrived.wait()
        return self.queue.popleft()

    def ready(self) -> list[Pushed | BadMessage]:
        if self.held:
            return []
        ready, self.queue = list(self.queue), collections.deque()
        return ready


class Orchestrator:
    def __init__(self, max_message_bytes: int = 1 << 20) -> None:
        self.front, self.inbox = Front(), Inbox()
        inbox: Any = self.inbox
        self.streams = ClientStreams(self.front, inbox, 100.0, max_message_bytes)
        self.watches: list[Watch] = []
        self.fail: PipelineError | None = None

    def add(self, request_id: str, count: int = 1) -> None:
        decided = self.front.decided.setdefault(request_id, [])
        for _ in range(count):
            decided.append(Chunk(len(decided), f"<{request_id}{len(decided)}>", [len(decided)]))
        self.streams.news({request_id})

    def finish(self, request_id: str) -> None:
        self.front.results[request_id] = result(request_id, len(self.front.decided[request_id]))
        self.streams.news({request_id})

    async def call(self, watch: Watch, wait: float) -> Watched:
        self.watches.append(watch)
        if self.fail is not None:
            raise self.fail
        await trio.sleep(0.05)  # on its way: pushes sent meanwhile still follow the older watch
        reply = await self.streams.watch(watch)
        if isinstance(reply, ErrorReply):
            raise PipelineError(reply.kind, reply.message)
        assert isinstance(reply, Watched)
        return reply

    def feed(self, wait: float = 5.0) -> PushFeed:
        return PushFeed(self.call, PipelineError, self.inbox, wait)


def run(main) -> None:  # type: ignore[no-untyped-def]
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def until_finished(
    got: dict[str, list], ids: list[str], nursery: trio.Nursery, within: float = 1.0
) -> None:
    """Until every reader has its final `Result`; then the feed's tasks end. Sooner than a watch's
    wait, which would renew the subscription and so hide a missed repair."""
    with trio.fail_after(within):
        while not all(got.get(i) and isinstance(got[i][-1], Result) for i in ids):
            await trio.sleep(0.1)
    nursery.cancel_scope.cancel()


def test_every_stream_gets_its_chunks_once_in_order_pushed_without_a_watch_per_burst():
    orchestrator, got = Orchestrator(), {}
    ids = ["a", "b", "c"]

    async def main() -> None:
        feed = orchestrator.feed(wait=60.0)
        for request_id in ids:
            orchestrator.front.decided[request_id] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            for request_id in ids:
                nursery.start_soon(read, feed, request_id, got)
            await trio.sleep(1)
            joined = len(orchestrator.watches)
            await bursts(orchestrator, ids)
            assert len(orchestrator.watches) == joined  # the 20 bursts went without a watch
            for request_id in ids:
                orchestrator.finish(request_id)
            assert all(orchestrator.front.pollers[i] > 0 for i in ids)  # read: not abandoned
            await until_finished(got, ids, nursery)

    run(main)
    for request_id in ids:
        assert texts(got[request_id]) == expected(request_id, 40)
        assert got[request_id][-1] == orchestrator.front.results[request_id]


@pytest.mark.parametrize("trouble", ["lose", "lose the end", "refuse", "repeat"])
def test_a_lost_refused_or_repeated_push_still_gives_every_chunk_once_in_order(trouble: str):
    """Lost: the pipe that closed makes the feed watch again, and the pushes that arrive before that
    watch does (the end among them) are past a gap, so dropped. The end lost too: nothing follows, so
    only the closed pipe tells. Refused: to the end of the stream, the watch answers with the news."""
    orchestrator, got = Orchestrator(), {}
    lose = trouble.startswith("lose")

    async def main() -> None:
        feed = orchestrator.feed(wait=60.0)  # no renewal hides a missed repair
        orchestrator.front.decided["a"] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            nursery.start_soon(read, feed, "a", got)
            await trio.sleep(1)
            orchestrator.add("a", 3)
            await trio.sleep(1)
            setattr(orchestrator.inbox, "held" if lose else trouble, True)
            for _ in range(4):
                orchestrator.add("a", 2)
                await trio.sleep(1)
            if trouble == "lose":
                orchestrator.inbox.lose()  # with 8 chunks in flight
                await trio.sleep(0)  # the feed hears of it, and watches again
            orchestrator.add("a")  # on the next pipe, before that watch arrives: past a gap
            orchestrator.finish("a")
            if trouble == "lose the end":
                orchestrator.inbox.lose()
            await until_finished(got, ["a"], nursery)

    run(main)
    assert texts(got["a"]) == expected("a", 12)
    assert got["a"][-1] == orchestrator.front.results["a"]


def test_a_slow_reader_is_held_to_a_bound_and_gets_the_rest_in_order():
    orchestrator, got = Orchestrator(), {}
    held: list[int] = []

    async def main() -> None:
        feed = orchestrator.feed()
        orchestrator.front.decided["slow"], orchestrator.front.decided["fast"] = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            nursery.start_soon(read, feed, "slow", got, 50.0)  # takes a batch every 50 s
            nursery.start_soon(read, feed, "fast", got)
            await slow_and_fast(orchestrator, feed, held)
            await until_finished(got, ["slow", "fast"], nursery, within=1000.0)

    run(main)
    assert max(held) <= MAX_HELD
    for request_id in ("slow", "fast"):
        assert texts(got[request_id]) == expected(request_id, 300)


def test_errors_end_the_streams_they_concern():
    orchestrator, errors = Orchestrator(), {}
    reader = functools.partial(read_to_error, errors=errors)

    async def main() -> None:
        feed = orchestrator.feed()
        orchestrator.front.decided["known"] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            nursery.start_soon(reader, feed, "gone")  # the orchestrator does not know it
            await trio.sleep(1)
            assert errors == {"gone": "unknown_request"}
            nursery.start_soon(reader, feed, "known")
            await trio.sleep(1)
            orchestrator.fail = PipelineError("unavailable", "no answer")
            await trio.sleep(10)  # the watch in flight lapses; the next call fails
            nursery.cancel_scope.cancel()

    run(main)
    assert errors == {"gone": "unknown_request", "known": "unavailable"}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "held", "lose", "refuse", "repeat", "join", "pause"]),
            st.integers(0, 2),
            st.integers(1, 4),
        ),
        max_size=40,
    ),
    st.sampled_from([250, 1 << 20]),
)
def test_whatever_the_inbox_does_each_reader_gets_every_chunk_once_in_order(ops, max_message_bytes):
    """Random steps of three requests; pushes held in flight, lost with a pipe, refused or repeated;
    readers joining late; messages small enough to be split or not."""
    orchestrator, got = Orchestrator(max_message_bytes), {}
    ids = ["r0", "r1", "r2"]

    async def main() -> None:
        feed = orchestrator.feed(wait=100.0)  # no renewal hides a missed repair
        for request_id in ids:
            orchestrator.front.decided[request_id] = []
        readers: set[str] = set()

        def join(request_id: str) -> None:
            if request_id not in readers:
                readers.add(request_id)
                nursery.start_soon(read, feed, request_id, got)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            join("r0")
            for op, which, count in ops:
                request_id, inbox = ids[which], orchestrator.inbox
                if op == "add":
                    orchestrator.add(request_id, count)
                elif op == "lose":
                    inbox.lose()
                elif op in ("held", "refuse", "repeat"):
                    setattr(inbox, op, not getattr(inbox, op))
                elif op == "join":
                    join(request_id)
                await trio.sleep(0.5 * count if op == "pause" else 0.01)
            orchestrator.inbox.refuse = orchestrator.inbox.repeat = False
            orchestrator.inbox.release()
            for request_id in ids:
                join(request_id)
                orchestrator.finish(request_id)
            await until_finished(got, ids, nursery)

    run(main)
    for request_id in ids:
        assert texts(got[request_id]) == expected(request_id, len(orchestrator.front.decided[request_id]))
        assert got[request_id][-1] == orchestrator.front.results[request_id]


@st.composite
def pushed_streams(draw: st.DrawFn) -> list[PushedStream]:
    streams = []
    for i in range(draw(st.integers(1, 4))):
        after, count = draw(st.integers(-1, 5)), draw(st.integers(0, 12))
        chunks = [Chunk(after + 1 + n, "x" * draw(st.integers(0, 40)), [n]) for n in range(count)]
        done = result(f"q{i}", after + 1 + count) if draw(st.booleans()) or not chunks else None
        streams.append(PushedStream(after, Chunks(request_id=f"q{i}", chunks=chunks, done=done)))
    return streams


@settings(max_examples=200, deadline=None)
@given(pushed_streams(), st.integers(100, 1500))
def test_pushes_are_split_to_fit_and_carry_every_chunk_once_in_order(streams, limit):
    """orchestration/pushes.py `parts`: each message fits, unless it is one chunk or one end; each part
    of a stream follows the one before it; together they carry every chunk once, and the end last."""
    codec: Codec[Pushed] = Codec(GatewayInbox)
    carried: dict[str, list[Chunk]] = {}
    after = {p.chunks.request_id: p.after for p in streams}
    ended: dict[str, Result] = {}
    for part, data in parts("w", streams, limit):
        assert codec.decode(data) == Pushed(watcher="w", streams=part)
        lone = len(part) == 1 and len(part[0].chunks.chunks) + (part[0].chunks.done is not None) <= 1
        assert len(data) <= limit or lone
        for pushed in part:
            request_id = pushed.chunks.request_id
            assert request_id not in ended and pushed.after == after[request_id]
            carried.setdefault(request_id, []).extend(pushed.chunks.chunks)
            after[request_id] = pushed.chunks.chunks[-1].seq if pushed.chunks.chunks else pushed.after
            if pushed.chunks.done is not None:
                ended[request_id] = pushed.chunks.done
    for pushed in streams:
        assert carried.get(pushed.chunks.request_id, []) == pushed.chunks.chunks
        assert ended.get(pushed.chunks.request_id) == pushed.chunks.done
