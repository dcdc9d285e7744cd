"""A client for a running pipeline: submit a request, then read its chunks as they are
decided. Chunks carry sequence numbers; reading is a long poll for "everything after
seq N", so a client that lost its connection (or is a new process) resumes from the
last chunk it saw and gets the rest exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pynng

from .messages import (
    Cancel,
    Chunk,
    Chunks,
    ClientReply,
    Codec,
    ErrorReply,
    Message,
    Poll,
    StatusQuery,
    StatusReport,
    Submit,
    Submitted,
    encode,
)
from .sampling import SamplingParams


class PipelineError(RuntimeError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class Client:
    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address, self.timeout = address, timeout
        self.codec: Codec[Any] = Codec(ClientReply)
        self.sock: pynng.Req0 | None = None

    def _connect(self) -> pynng.Req0:
        if self.sock is None:
            ms = int(self.timeout * 1000)
            # resend_time=0: nng must never repeat a request on its own (a Submit is not idempotent).
            self.sock = pynng.Req0(resend_time=0, recv_timeout=ms, send_timeout=ms, reconnect_time_min=100)
            self.sock.dial(self.address, block=False)
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
                reply = self.codec.decode(sock.recv())
                break
            except (pynng.Timeout, pynng.ConnectionReset, pynng.Closed) as exc:
                self.close()
                if not retry or time.monotonic() > deadline:
                    raise PipelineError("unavailable", f"no answer from {self.address}: {exc}") from None
                time.sleep(0.1)
        if isinstance(reply, ErrorReply):
            raise PipelineError(reply.kind, reply.message)
        return reply

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        chat: bool = False,
        params: SamplingParams | None = None,
        drafter: str | None = None,
        k: int | None = None,
        max_iterations: int | None = None,
    ) -> Submitted:
        submit = Submit(
            prompt=prompt, messages=messages, chat=chat, params=params or SamplingParams(),
            drafter=drafter, k=k, max_iterations=max_iterations,
        )  # fmt: skip
        return self.call(submit)

    def chunks(self, request_id: str, after: int = -1, wait: float = 5.0) -> Iterator[Chunk | dict[str, Any]]:
        """Chunks after `after`, as they come, then the final object (a dict)."""
        while True:
            reply: Chunks = self.call(Poll(request_id=request_id, after=after, wait=wait), retry=True)
            for chunk in reply.chunks:
                if chunk.seq == after + 1:
                    after = chunk.seq
                    yield chunk
            if reply.done is not None and (not reply.chunks or reply.chunks[-1].seq == after):
                yield reply.done
                return

    def complete(self, prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Submit and wait for the final object."""
        request_id = self.submit(prompt, **kwargs).request_id
        *_, done = self.chunks(request_id)
        assert isinstance(done, dict)
        return done

    def cancel(self, request_id: str) -> None:
        self.call(Cancel(request_id=request_id), retry=True)

    def status(self) -> StatusReport:
        return self.call(StatusQuery(), retry=True)

    def wait_ready(self, timeout: float = 60.0) -> StatusReport:
        """Until every lane this pipeline runs reports in (the orchestrator answering is not enough)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                report = self.status()
                if all(lane.state == "up" for lane in report.lanes):
                    return report
            except PipelineError as exc:
                last = exc
            time.sleep(0.2)
        raise PipelineError(
            "unavailable", f"the pipeline at {self.address} is not ready after {timeout:.0f} s ({last})"
        )
