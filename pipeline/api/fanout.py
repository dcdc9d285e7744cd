"""The gateway's side of `n` > 1: the choices' pipeline requests read at once, merged into one
HTTP response (the wire format is api/choices.py's).

Each choice's chunks are polled by a task of its own, so a choice that is decided faster is
never held up behind a slower one; a stream interleaves their chunks as they come. A stream's
tasks live in a nursery around Starlette's body loop (`ChoicesStream.stream_response`) rather
than in the body's async generator, which must not hold a nursery across its yields.

Every choice is cancelled in the pipeline when the client goes away, when one choice fails
(the response is that failure), and in any case once the response is over (a no-op for the
choices that finished).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import trio
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from pipeline.api import choices
from pipeline.api.core import DONE_EVENT, Formatter, event, failure
from pipeline.api.errors import ApiError, pipeline_error
from pipeline.api.generation import cancel_on_disconnect
from pipeline.decoding.result import Result
from pipeline.protocol.client import PipelineError
from pipeline.protocol.messages import Submit


class Choice(Protocol):
    """One choice's pipeline request (the gateway's `Generation`)."""

    def items(self) -> AsyncIterator[Any]: ...
    async def close(self) -> None: ...


C = TypeVar("C", bound=Choice)


async def open_choices(
    submits: list[Submit], start: Callable[[Submit], Awaitable[tuple[C, int]]]
) -> list[tuple[C, int]]:
    """Every choice's request submitted at once (`start`: a choice and the prompt's length, or an
    ApiError). If one is refused, those already in are cancelled and the refusal is the answer."""
    opened: dict[int, tuple[C, int]] = {}
    refused: list[ApiError] = []

    async def one(index: int, submit: Submit) -> None:
        try:
            opened[index] = await start(submit)
        except ApiError as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        for index, submit in enumerate(submits):
            nursery.start_soon(one, index, submit)
    if refused:
        for choice, _ in opened.values():
            await choice.close()
        raise refused[0]
    return [opened[i] for i in range(len(submits))]


class Fanout:
    def __init__(self, generations: list[Choice], fmt: Formatter) -> None:
        self.generations, self.fmt = generations, fmt
        self.streams = [fmt.for_choice() for _ in generations]  # each choice's own stream state

    async def close(self) -> None:
        for generation in self.generations:
            await generation.close()

    async def _pump(self, index: int, generation: Choice, send: trio.MemorySendChannel[Any]) -> None:
        async with send:
            try:
                async for item in generation.items():
                    await send.send((index, item))
            except PipelineError as exc:  # the orchestrator went away
                await send.send((index, pipeline_error(exc.kind, exc.message)))

    async def events(self, nursery: trio.Nursery, include_usage: bool) -> AsyncIterator[bytes]:
        """The merged stream: every choice's opening, its chunks as they come, its closing chunk;
        then the summed usage (include_usage) and [DONE]. The first failure ends it."""
        fmt, n = self.fmt, len(self.generations)
        send, receive = trio.open_memory_channel[Any](math.inf)
        async with send:
            for index, generation in enumerate(self.generations):
                nursery.start_soon(self._pump, index, generation, send.clone())
        done: dict[int, Result] = {}
        try:
            for chunk in choices.opening_chunks(fmt, n):
                yield event(chunk)
            async for index, item in receive:
                error = (
                    item
                    if isinstance(item, ApiError)
                    else failure(item)
                    if isinstance(item, Result)
                    else None
                )
                if error is not None:
                    yield event(error.body())
                    break
                if isinstance(item, Result):
                    done[index] = item
                    yield event(choices.closing_chunk(self.streams[index], item, index))
                elif (chunk := self.streams[index].text(item.text, item.logprobs, item.decided)) is not None:
                    yield event(choices.indexed(chunk, index))
            if include_usage and len(done) == n:
                yield event(choices.usage_chunk(fmt, [done[i] for i in range(n)]))
        finally:
            await self.close()
        yield DONE_EVENT

    async def collect(self, request: Request) -> dict[str, Any]:
        """The whole response once every choice is done, while watching for the client to leave."""
        done: dict[int, Result] = {}
        errors: list[ApiError] = []
        try:
            async with trio.open_nursery() as nursery:

                async def gather(index: int, generation: Choice) -> None:
                    try:
                        async for item in generation.items():
                            if isinstance(item, Result):
                                done[index] = item
                    except PipelineError as exc:
                        errors.append(pipeline_error(exc.kind, exc.message))
                    if index in done and (error := failure(done[index])) is not None:
                        errors.append(error)
                    if errors:  # one choice failed: so does the response, at once
                        nursery.cancel_scope.cancel()

                nursery.start_soon(cancel_on_disconnect, request, nursery.cancel_scope)
                async with trio.open_nursery() as gathering:
                    for index, generation in enumerate(self.generations):
                        gathering.start_soon(gather, index, generation)
                nursery.cancel_scope.cancel()
        finally:
            await self.close()
        if errors:
            raise errors[0]
        if len(done) < len(self.generations):  # the client left; nobody reads this
            raise ApiError(499, "the client closed the request", code="client_closed_request")
        return choices.response(self.fmt, [done[i] for i in range(len(done))])


class ChoicesStream(StreamingResponse):
    """Server-Sent Events of every choice, merged; the choices' tasks run around the body loop."""

    def __init__(self, fanout: Fanout, include_usage: bool) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        # The body iterator is made in stream_response, inside the nursery its tasks need.
        super().__init__(
            [], media_type="text/event-stream", headers=headers, background=BackgroundTask(fanout.close)
        )
        self.fanout, self.include_usage = fanout, include_usage

    async def stream_response(self, send: Send) -> None:
        gone: OSError | None = None
        async with trio.open_nursery() as nursery:
            self.body_iterator = self.fanout.events(nursery, self.include_usage)
            try:
                await super().stream_response(send)
            except OSError as exc:  # the client went away: Starlette expects it as is, not in a group
                gone = exc
            nursery.cancel_scope.cancel()
        if gone is not None:
            raise gone
