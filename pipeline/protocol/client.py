"""A client for a running pipeline: submit a request, then read its chunks as they are
decided. Chunks carry sequence numbers; reading is a long poll for "everything after
seq N", so a client that lost its connection (or is a new process) resumes from the
last chunk it saw and gets the rest exactly once.

`Client` blocks; `AsyncClient` is the same protocol under trio (the HTTP gateway uses it):
one socket, one Req0 context per call, so many requests share it concurrently. Both build
their messages and read their replies with the same functions below.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pynng
import trio

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.config import ESSENTIAL
from pipeline.protocol.messages import (
    Cancel,
    Chunk,
    Chunks,
    ClientReply,
    Codec,
    ErrorReply,
    LaneStatus,
    Message,
    Poll,
    StatusQuery,
    StatusReport,
    Submit,
    Submitted,
    encode,
)


class PipelineError(RuntimeError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


_codec: Codec[Any] = Codec(ClientReply)
NETWORK_ERRORS = (pynng.Timeout, pynng.ConnectionReset, pynng.Closed)


def _socket(address: str, timeout: float) -> pynng.Req0:
    ms = int(timeout * 1000)
    # resend_time=0: nng must never repeat a request on its own (a Submit is not idempotent).
    sock = pynng.Req0(resend_time=0, recv_timeout=ms, send_timeout=ms, reconnect_time_min=100)
    sock.dial(address, block=False)
    return sock


def _unwrap(data: bytes) -> Any:
    reply = _codec.decode(data)
    if isinstance(reply, ErrorReply):
        raise PipelineError(reply.kind, reply.message)
    return reply


def _unavailable(address: str, exc: BaseException) -> PipelineError:
    return PipelineError("unavailable", f"no answer from {address}: {str(exc) or type(exc).__name__}")


def submit_message(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    chat: bool = False,
    params: SamplingParams | None = None,
    drafter: str | None = None,
    k: int | None = None,
    max_iterations: int | None = None,
) -> Submit:
    return Submit(
        prompt=prompt, messages=messages, chat=chat, params=params or SamplingParams(),
        drafter=drafter, k=k, max_iterations=max_iterations,
    )  # fmt: skip


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


class Client:
    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address, self.timeout = address, timeout
        self.sock: pynng.Req0 | None = None

    def _connect(self) -> pynng.Req0:
        if self.sock is None:
            self.sock = _socket(self.address, self.timeout)
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, message: Message, *, retry: bool = False) -> Any:
        """One request/reply; with `retry` (idempotent calls only) reconnect and repeat until timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            sock = self._connect()
            try:
                sock.send(encode(message))
                data = sock.recv()
                break
            except NETWORK_ERRORS as exc:
                self.close()
                if not retry or time.monotonic() > deadline:
                    raise _unavailable(self.address, exc) from None
                time.sleep(0.1)
        return _unwrap(data)

    def submit(self, prompt: str | None = None, **kwargs: Any) -> Submitted:
        """Keyword arguments as `submit_message` takes them."""
        return self.call(submit_message(prompt, **kwargs))

    def chunks(self, request_id: str, after: int = -1, wait: float = 5.0) -> Iterator[Chunk | Result]:
        """Chunks after `after`, as they come, then the final `Result`."""
        while True:
            reply: Chunks = self.call(Poll(request_id=request_id, after=after, wait=wait), retry=True)
            fresh, after, done = continuation(reply, after)
            yield from fresh
            if done is not None:
                yield done
                return

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Submit and wait for the final result."""
        request_id = self.submit(prompt, **kwargs).request_id
        *_, done = self.chunks(request_id)
        assert isinstance(done, Result)
        return done

    def cancel(self, request_id: str) -> None:
        self.call(Cancel(request_id=request_id), retry=True)

    def status(self) -> StatusReport:
        return self.call(StatusQuery(), retry=True)

    def wait_ready(self, timeout: float = 60.0, ours: Callable[[], bool] | None = None) -> StatusReport:
        """Until every lane this pipeline runs reports in (the orchestrator answering is not enough)
        or, a draft, audit or gateway lane, has failed (the pipeline serves on, degraded). `ours`,
        checked first each round, says whether the answering pipeline is the awaited one yet
        (False: wait on); it raises to give up at once."""
        deadline = time.monotonic() + timeout
        last: Exception | str | None = None
        while time.monotonic() < deadline:
            if ours is not None and not ours():
                time.sleep(0.05)
                continue
            try:
                report = self.status()
                if all(_settled(lane) for lane in report.lanes):
                    return report
                last = "not up: " + ", ".join(f"{x.name} {x.state}" for x in report.lanes if x.state != "up")
            except PipelineError as exc:
                last = exc
            time.sleep(0.2)
        raise PipelineError(
            "unavailable", f"the pipeline at {self.address} is not ready after {timeout:.0f} s ({last})"
        )


def _settled(lane: LaneStatus) -> bool:
    """Up, or failed where the pipeline serves on without it (degraded): waiting cannot change it."""
    return lane.state == "up" or (lane.state == "failed" and lane.name not in ESSENTIAL)


class AsyncClient:
    """`Client` under trio: every call opens its own Req0 context on one shared socket, so
    concurrent streams do not queue behind each other's long polls. Calls are bounded by
    trio timeouts (pynng's async calls ignore nng's) and honour trio cancellation."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address, self.timeout = address, timeout
        self.sock = _socket(address, timeout)

    def close(self) -> None:
        self.sock.close()

    async def call(self, message: Message, *, retry: bool = False, timeout: float | None = None) -> Any:
        """One request/reply; with `retry` (idempotent calls only) repeat until the timeout."""
        timeout = self.timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        data = encode(message)
        while True:
            ctx = self.sock.new_context()
            try:
                with trio.fail_after(max(deadline - trio.current_time(), 0.0)):
                    await ctx.asend(data)
                    reply = await ctx.arecv()
                return _unwrap(reply)
            except (*NETWORK_ERRORS, trio.TooSlowError) as exc:
                if not retry or trio.current_time() >= deadline:
                    raise _unavailable(self.address, exc) from None
            finally:
                ctx.close()
            await trio.sleep(0.1)

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> Submitted:
        """Keyword arguments as `submit_message` takes them."""
        return await self.call(submit_message(prompt, **kwargs))

    async def chunks(
        self, request_id: str, after: int = -1, wait: float = 5.0
    ) -> AsyncIterator[Chunk | Result]:
        """Chunks after `after`, as they come, then the final `Result`."""
        while True:
            poll = Poll(request_id=request_id, after=after, wait=wait)
            reply: Chunks = await self.call(poll, retry=True, timeout=self.timeout + wait)
            fresh, after, done = continuation(reply, after)
            for chunk in fresh:
                yield chunk
            if done is not None:
                yield done
                return

    async def cancel(self, request_id: str) -> None:
        await self.call(Cancel(request_id=request_id), retry=True)

    async def status(self, timeout: float | None = None) -> StatusReport:
        return await self.call(StatusQuery(), retry=True, timeout=timeout)
