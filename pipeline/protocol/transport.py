"""nng sockets under trio.

Receives and sends use non-blocking calls and, when nng says "try again", wait on the
socket's notification descriptor (`recv_fd`/`send_fd`, both polled for readability): half
the round-trip of pynng's own async calls. That path ignores nng's timeouts, so callers
bound waits with trio. A wait on the descriptor also ends after `RECHECK_SECONDS` and tries
again: nng has had lost poll wakeups (nanomsg/nng#1368, #362), and one lost here would leave a
message unread until the next arrived (an audit event unacknowledged for good, seen once in CI).
Every inbox listens and every sender dials, so a restarted process comes back on the same
address and its peers reconnect on their own. On a tls+tcp:// address both ends authenticate
with the [tls] certificates (pipeline/protocol/tls.py).

Pull/Push for everything that must arrive (Pub/Sub drops silently). Req/Rep only for
clients, whose polls are idempotent.
"""

from __future__ import annotations

import contextlib
import math
import select
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Generic, TypeVar

import msgspec
import pynng
import trio

from pipeline.protocol.config import Tls
from pipeline.protocol.messages import BadMessage, Codec, encode
from pipeline.protocol.tls import socket_options

T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20
RECHECK_SECONDS = 0.25  # the longest a message can wait behind a lost wakeup
# A dialer whose peer died tries again after 100 ms, doubling up to 250 ms: a restarted lane counts as
# up only once the orchestrator's socket to it has reconnected, and a back-off up to 1 s held a
# restart's requests that much longer. A failed dial is one refused connect.
OPTIONS = {"reconnect_time_min": 100, "reconnect_time_max": 250, "recv_max_size": MAX_MESSAGE_BYTES}


def _prepare(address: str) -> None:
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)


def listen(
    kind: type[pynng.Socket], address: str, tls: Tls | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> pynng.Socket:
    """`max_message_bytes`: nng closes the connection of a peer that sends a larger message, before
    reading it (a Req peer with resend_time=0 gets ConnectionReset); the socket serves on."""
    _prepare(address)
    sock = kind(
        **(OPTIONS | {"recv_max_size": max_message_bytes}), **socket_options(address, tls, server=True)
    )
    try:
        sock.listen(address)
    except pynng.NNGException as exc:
        sock.close()
        raise OSError(f"cannot listen on {address}: {exc}") from None
    return sock


def dial(kind: type[pynng.Socket], address: str, tls: Tls | None = None, buffer: int = 0) -> pynng.Socket:
    """`buffer`: messages the socket holds while its pipe is still writing the previous ones. With
    none, a non-blocking send right behind another fails (measured: 168 of 200 back-to-back)."""
    extra = {"send_buffer_size": buffer} if buffer else {}
    sock = kind(**OPTIONS, **extra, **socket_options(address, tls, server=False))
    sock.dial(address, block=False)  # connects (and reconnects) in the background
    return sock


def _recv_now(sock: pynng.Socket) -> bytes:
    try:
        return sock.recv(block=False)
    except RuntimeError:  # pynng cannot unpack a zero-length message (NULL data): it was empty
        return b""


async def _wait_readable(fd: int) -> None:
    with trio.move_on_after(RECHECK_SECONDS):
        await trio.lowlevel.wait_readable(fd)


async def receive(sock: pynng.Socket) -> bytes:
    while True:
        try:
            return _recv_now(sock)
        except pynng.TryAgain:
            await _wait_readable(sock.recv_fd)


async def send(sock: pynng.Socket, data: bytes) -> None:
    while True:
        try:
            sock.send(data, block=False)
            return
        except pynng.TryAgain:
            await _wait_readable(sock.send_fd)


def _request_now(ctx: pynng.Context, data: bytes) -> bool:
    """`data` handed to the Req context's pipe now if one can take it: nng's non-blocking
    `nng_ctx_sendmsg`, which pynng does not wrap. False (the message freed, the context as new) when
    it would have to wait. Req only: a Rep context gives up the request it answers on the first try
    (nng's rep0 clears it before it finds the pipe busy), so its reply could not be sent again."""
    lib, ffi = pynng.lib, pynng.ffi
    msg_p = ffi.new("nng_msg **")
    pynng.exceptions.check_err(lib.nng_msg_alloc(msg_p, 0))
    msg = msg_p[0]
    result = lib.nng_msg_append(msg, data, len(data))
    if result == 0:
        result = lib.nng_ctx_sendmsg(ctx.context, msg, lib.NNG_FLAG_NONBLOCK)
        if result == 0:
            return True  # nng owns the message now
    lib.nng_msg_free(msg)
    if result == lib.NNG_EAGAIN:
        return False
    pynng.exceptions.check_err(result)
    return False


async def send_request(ctx: pynng.Context, data: bytes) -> None:
    """A Req context's request. Why not only `ctx.asend`: pynng completes every async call from
    nng's thread through trio's `run_sync_soon`, and that completion wakes the event loop once more
    for every request, though the pipe took it at once (each wake-up about 0.5 ms of CPU on a 2-core
    VM, lanes/ticker.py; when the gateway still long-polled, about 20 of them a second while a stream
    ran). Sent now when a pipe can take it, else the async send waits as before."""
    if not _request_now(ctx, data):
        await ctx.asend(data)


def receive_ready(sock: pynng.Socket) -> bytes | None:
    """A message if one is already queued, without waiting."""
    try:
        return _recv_now(sock)
    except pynng.TryAgain:
        return None


class Inbox(Generic[T]):
    """A listening Pull socket that yields decoded messages, or BadMessage for garbage
    (so the owner reports it and carries on: bad bytes never end a loop)."""

    def __init__(
        self, address: str, union: object, tls: Tls | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.sock = listen(pynng.Pull0, address, tls, max_message_bytes)
        self.codec: Codec[T] = Codec(union)
        self._descriptor = select.poll()
        self._descriptor.register(self.sock.recv_fd, select.POLLIN)

    def decode(self, data: bytes) -> T | BadMessage:
        try:
            return self.codec.decode(data)
        except BadMessage as exc:
            return exc

    async def next(self) -> T | BadMessage:
        return self.decode(await receive(self.sock))

    def waiting(self) -> bool:
        """Whether nng's descriptor says a message is queued: one poll, no receive. nng has missed
        wake-ups (see above), so a caller that relies on this still reads with `ready` now and then."""
        return bool(self._descriptor.poll(0))

    def ready(self) -> list[T | BadMessage]:
        """Everything already queued."""
        out = []
        while (data := receive_ready(self.sock)) is not None:
            out.append(self.decode(data))
        return out

    async def __aiter__(self) -> AsyncIterator[T | BadMessage]:
        while True:
            yield await self.next()

    def on_pipe_closed(self, callback: Callable[[], object]) -> None:
        """`callback()` in this trio run's thread whenever a sender's pipe closes: whatever was in
        flight on it is lost (nng calls the hook from its own thread)."""
        token = trio.lowlevel.current_trio_token()

        def closed(_pipe: pynng.Pipe) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(callback)

        self.sock.add_post_pipe_remove_cb(closed)

    def close(self) -> None:
        self.sock.close()


class Outbox:
    """A dialing Push socket. `put` waits (bounded) for a connected peer; a message that
    cannot be handed over in time raises trio.TooSlowError for the caller to retry."""

    def __init__(self, address: str, tls: Tls | None = None, buffer: int = 0) -> None:
        self.address = address
        self.sock = dial(pynng.Push0, address, tls, buffer)
        self._lock = trio.Lock()

    async def put(self, message: msgspec.Struct, timeout: float = math.inf) -> None:
        await self.put_bytes(encode(message), timeout)

    async def put_bytes(self, data: bytes, timeout: float = math.inf) -> None:
        with trio.fail_after(timeout):
            async with self._lock:
                await send(self.sock, data)

    def connected(self) -> bool:
        """Whether a peer is connected now, so that a message put now is handed over."""
        return bool(self.sock.pipes)

    def put_nowait(self, message: msgspec.Struct) -> bool:
        """Hand over if a peer can take it now; False otherwise (the caller keeps it)."""
        return self.put_bytes_nowait(encode(message))

    def put_bytes_nowait(self, data: bytes) -> bool:
        try:
            self.sock.send(data, block=False)
            return True
        except pynng.TryAgain:
            return False

    def close(self) -> None:
        self.sock.close()
