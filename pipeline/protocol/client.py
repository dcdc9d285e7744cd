"""A client for a running pipeline: submit a request, then read its chunks as they are
decided. Chunks carry sequence numbers; reading is a long poll for "everything after
seq N", so a client that lost its connection (or is a new process) resumes from the
last chunk it saw and gets the rest exactly once.

`Client` blocks; `AsyncClient` is the same protocol under trio (the HTTP gateway uses it):
one socket, one Req0 context per call, so many requests share it concurrently, and one long poll
(`Watch`) for the chunks of all its streams at once (`AsyncClient.stream`, protocol/feed.py). Both build
their messages and read their replies with the same functions below. A `tls+tcp://` pipeline
answers only a client that shows a certificate its CA signed: pass the [tls] section as `tls`.

Every call is retried across a restart of the orchestrator, Submit included: it carries a
random idempotency key, so a Submit whose reply was lost gets the same request back. A client
keeps the secret each Submit was answered with and presents it to read or cancel that request;
another process resuming a stream passes the secret itself.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pynng
import trio

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.config import ESSENTIAL, Tls
from pipeline.protocol.feed import Feed, continuation, merged
from pipeline.protocol.messages import (
    Cancel,
    Chunk,
    Chunks,
    ClientReply,
    Codec,
    Detokenize,
    ErrorReply,
    LaneStatus,
    Message,
    MetricsQuery,
    MetricsReport,
    Poll,
    StatusQuery,
    StatusReport,
    Submit,
    Submitted,
    Text,
    Tokenize,
    Tokens,
    Watch,
    Watched,
    encode,
)
from pipeline.protocol.push_feed import PushFeed, Receiver
from pipeline.protocol.tls import socket_options
from pipeline.protocol.transport import send_request


class PipelineError(RuntimeError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


_codec: Codec[Any] = Codec(ClientReply)
NETWORK_ERRORS = (pynng.Timeout, pynng.ConnectionReset, pynng.Closed)


def _socket(address: str, timeout: float, tls: Tls | None) -> pynng.Req0:
    ms = int(timeout * 1000)
    # resend_time=0: nng must never repeat a request on its own (a Submit is not idempotent).
    options = socket_options(address, tls, server=False)
    sock = pynng.Req0(resend_time=0, recv_timeout=ms, send_timeout=ms, reconnect_time_min=100, **options)
    sock.dial(address, block=False)
    return sock


def _unwrap(data: bytes) -> Any:
    reply = _codec.decode(data)
    if isinstance(reply, ErrorReply):
        raise PipelineError(reply.kind, reply.message)
    return reply


def _sized(message: Message, limit: int | None) -> bytes:
    """The encoded message, or a clear error when the orchestrator would refuse it for its size
    (admission.max_message_bytes): nng would only drop the connection, saying nothing."""
    data = encode(message)
    if limit is not None and len(data) > limit:
        raise PipelineError(
            "too_large",
            f"the request is {len(data)} bytes; the orchestrator takes at most {limit} "
            "(admission.max_message_bytes)",
        )
    return data


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
    owner: str = "",
    prompt_token_ids: list[int] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_messages: list[dict[str, Any]] | None = None,
) -> Submit:
    return Submit(
        prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids, chat=chat,
        params=params or SamplingParams(), drafter=drafter, k=k, max_iterations=max_iterations,
        owner=owner, idempotency_key=uuid.uuid4().hex, tools=tools, tool_messages=tool_messages,
    )  # fmt: skip


class Secrets(dict[str, str]):
    """The secrets of the requests this client submitted, by request id."""

    def keep(self, submitted: Submitted) -> Submitted:
        self[submitted.request_id] = submitted.secret
        return submitted

    def of(self, request_id: str, secret: str | None) -> str:
        return self.get(request_id, "") if secret is None else secret


class Endpoint:
    """What both clients hold: where the orchestrator is, how long a call may take, the TLS
    configuration, the message size cap, and the secrets of the requests submitted here."""

    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        tls: Tls | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.address, self.timeout, self.tls = address, timeout, tls
        self.max_message_bytes = max_message_bytes
        self.secrets = Secrets()


class Client(Endpoint):
    sock: pynng.Req0 | None = None

    def _connect(self) -> pynng.Req0:
        if self.sock is None:
            self.sock = _socket(self.address, self.timeout, self.tls)
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
        deadline, data = time.monotonic() + self.timeout, _sized(message, self.max_message_bytes)
        while True:
            sock = self._connect()
            try:
                sock.send(data)
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
        return self.request(submit_message(prompt, **kwargs))

    def request(self, submit: Submit) -> Submitted:
        """A Submit built elsewhere; retried safely (its idempotency key)."""
        return self.secrets.keep(self.call(submit, retry=True))

    def chunks(
        self, request_id: str, after: int = -1, wait: float = 5.0, secret: str | None = None
    ) -> Iterator[Chunk | Result]:
        """Chunks after `after`, as they come, then the final `Result`."""
        secret = self.secrets.of(request_id, secret)
        while True:
            poll = Poll(request_id=request_id, secret=secret, after=after, wait=wait)
            reply: Chunks = self.call(poll, retry=True)
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

    def cancel(self, request_id: str, secret: str | None = None) -> None:
        self.call(Cancel(request_id=request_id, secret=self.secrets.of(request_id, secret)), retry=True)

    def status(self) -> StatusReport:
        return self.call(StatusQuery(), retry=True)

    def metrics(self) -> MetricsReport:
        """The pipeline's metrics in the Prometheus text format (what the gateway's /metrics serves)."""
        return self.call(MetricsQuery(), retry=True)

    def tokenize(self, text: str | None = None, **fields: Any) -> Tokens:
        """The served model's ids for `text` (or `messages=[...]`); fields as `Tokenize` takes them."""
        return self.call(Tokenize(text=text, **fields), retry=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self.call(Detokenize(tokens=tokens), retry=True).text

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


class AsyncClient(Endpoint):
    """`Client` under trio: every call opens its own Req0 context on one shared socket, so
    concurrent streams do not queue behind each other's long polls. Calls are bounded by
    trio timeouts (pynng's async calls ignore nng's) and honour trio cancellation."""

    @functools.cached_property
    def sock(self) -> pynng.Req0:
        return _socket(self.address, self.timeout, self.tls)

    def close(self) -> None:
        self.sock.close()

    async def call(self, message: Message, *, retry: bool = False, timeout: float | None = None) -> Any:
        """One request/reply; with `retry` (idempotent calls only) repeat until the timeout."""
        timeout = self.timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        data = _sized(message, self.max_message_bytes)
        while True:
            ctx = self.sock.new_context()
            try:
                with trio.fail_after(max(deadline - trio.current_time(), 0.0)):
                    await send_request(ctx, data)
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
        return await self.request(submit_message(prompt, **kwargs))

    async def request(self, submit: Submit) -> Submitted:
        """A Submit built elsewhere; retried safely (its idempotency key)."""
        return self.secrets.keep(await self.call(submit, retry=True))

    async def chunks(
        self, request_id: str, after: int = -1, wait: float = 5.0
    ) -> AsyncIterator[Chunk | Result]:
        """Chunks after `after`, as they come, then the final `Result`."""
        secret = self.secrets.of(request_id, None)
        while True:
            poll = Poll(request_id=request_id, secret=secret, after=after, wait=wait)
            reply: Chunks = await self.call(poll, retry=True, timeout=self.timeout + wait)
            fresh, after, done = continuation(reply, after)
            for chunk in fresh:
                yield chunk
            if done is not None:
                yield done
                return

    @functools.cached_property
    def feed(self) -> Feed | PushFeed:
        """What `stream` reads: one long poll for all streams, or pushes once `receive_pushes` said so."""
        return Feed(self._watch, PipelineError)

    def receive_pushes(self, inbox: Receiver) -> PushFeed:
        """From now on `stream` reads the chunks the orchestrator pushes onto `inbox` (the gateway's:
        protocol/push_feed.py). The caller runs the returned feed's `run` task."""
        feed = self.__dict__["feed"] = PushFeed(self._watch, PipelineError, inbox)
        return feed

    async def _watch(self, watch: Watch, wait: float) -> Watched:
        return await self.call(watch, retry=True, timeout=self.timeout + wait)

    async def stream(self, request_id: str, after: int = -1) -> AsyncIterator[list[Chunk | Result]]:
        """What `chunks` yields, in batches: whatever arrived since the last batch was taken, read
        with every other stream of this client in one long poll (`Watch`). A batch holds one chunk
        (`merged`: a reader slower than the tokens gets them coalesced), the final `Result`, or both."""
        async for batch in self.feed.items(request_id, self.secrets.of(request_id, None), after):
            chunks = [item for item in batch if isinstance(item, Chunk)]
            yield [merged(chunks), *batch[len(chunks) :]] if chunks else batch

    async def cancel(self, request_id: str) -> None:
        await self.call(Cancel(request_id=request_id, secret=self.secrets.of(request_id, None)), retry=True)

    def forget(self, request_id: str) -> None:
        """The request is over for this client: its secret is no longer needed."""
        self.secrets.pop(request_id, None)

    async def status(self, timeout: float | None = None) -> StatusReport:
        return await self.call(StatusQuery(), retry=True, timeout=timeout)

    async def metrics(self, timeout: float | None = None) -> MetricsReport:
        return await self.call(MetricsQuery(), retry=True, timeout=timeout)

    async def tokenizer_call(self, message: Tokenize | Detokenize) -> Tokens | Text:
        """A `Tokenize` or `Detokenize` built elsewhere (the gateway's /tokenize and /detokenize)."""
        return await self.call(message, retry=True)
