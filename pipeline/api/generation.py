"""One pipeline request behind one HTTP request, whichever surface it came from: submitted, then
streamed as Server-Sent Events or collected into one response by the surface's formatter
(api/core.py's `Formatter`). `n` > 1 is api/fanout.py's, over the same `Generation`s.

A client that goes away mid-request (stream or not) gets its pipeline request cancelled at
once rather than after the orchestrator's idle timeout: the KV cache and the verifier's
batch slot are freed for the clients still there.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import trio
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pipeline.api.core import Formatter, failure
from pipeline.api.errors import ApiError, pipeline_error
from pipeline.decoding.result import Result
from pipeline.protocol.client import AsyncClient, PipelineError

log = logging.getLogger(__name__)

CANCEL_SECONDS = 5.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Owner(Protocol):
    """What a Generation needs of the gateway: its client, and the count of open requests it reports."""

    client: AsyncClient

    def opened(self, generation: Generation) -> None: ...
    def closed(self, generation: Generation) -> None: ...


class Generation:
    """One pipeline request behind one HTTP request: its chunks, and a cancel that is sent
    exactly once unless the request has finished."""

    def __init__(self, owner: Owner, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.done: Result | None = None
        self.closed = False
        owner.opened(self)

    async def items(self) -> AsyncIterator[Any]:
        """Its chunks, then the final Result. The client reads all of the gateway's streams in one
        long poll and hands over whatever arrived since the last item as one chunk, so a reader that
        falls behind gets fewer, longer chunks, and nothing waits in a queue of its own."""
        async for batch in self.owner.client.stream(self.request_id):
            for item in batch:
                if isinstance(item, Result):
                    self.done = item
                yield item

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.closed(self)
        if self.done is not None:
            self.owner.client.forget(self.request_id)
            return
        log.info("client of %s went away: cancelling it", self.request_id)
        with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SECONDS):
            try:
                await self.owner.client.cancel(self.request_id)
            except PipelineError as exc:
                log.warning("cancelling %s failed: %s", self.request_id, exc)
        self.owner.client.forget(self.request_id)


def streamed(generation: Generation, fmt: Formatter, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(
        events(generation, fmt, include_usage),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(generation.close),  # runs also when the client left
    )


async def events(generation: Generation, fmt: Formatter, include_usage: bool) -> AsyncIterator[bytes]:
    """The stream: the surface's opening, a chunk per pipeline chunk, its closing; a failure in the
    pipeline is the last event before the end."""
    try:
        if opening := fmt.stream_opening():
            yield b"".join(opening)
        async for item in generation.items():  # each item's events in one write
            if not isinstance(item, Result):
                if data := fmt.stream_text(item.text, item.logprobs, item.decided):
                    yield b"".join(data)
            elif (error := failure(item)) is not None:
                yield b"".join(fmt.stream_error(error))
            else:
                yield b"".join(fmt.stream_closing(item, include_usage))
    except PipelineError as exc:  # the orchestrator went away mid-stream
        for data in fmt.stream_error(pipeline_error(exc.kind, exc.message)):
            yield data
    finally:
        await generation.close()
    if fmt.stream_end:  # chat and completions end with [DONE]; the Responses API with its last event
        yield fmt.stream_end


async def cancel_on_disconnect(request: Request, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the client of a whole (not streamed) response goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def collect(request: Request, generation: Generation, fmt: Formatter) -> dict[str, Any]:
    """The whole response, while watching for the client to disconnect."""
    done: Result | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, request, nursery.cancel_scope)
            async for item in generation.items():
                if isinstance(item, Result):
                    done = item
            nursery.cancel_scope.cancel()
    except PipelineError as exc:
        raise pipeline_error(exc.kind, exc.message) from None
    finally:
        await generation.close()
    if done is None:  # the client left; nobody reads this
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    if (error := failure(done)) is not None:
        raise error
    return fmt.response(done)
