"""The nng-under-trio transport: a message that arrives while a receiver waits is received even
if nng's poll wakeup for it never comes."""

from __future__ import annotations

import time

import pynng
import pytest
import trio

from pipeline.protocol import transport
from pipeline.protocol.transport import RECHECK_SECONDS, dial, listen, receive


def wait_connected(dialer: pynng.Socket) -> None:
    """Until the dialer's background connect has made a pipe (at most 5 s)."""
    deadline = time.monotonic() + 5
    while not dialer.pipes and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_message_whose_wakeup_is_lost_is_still_received(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver is already waiting when the message comes, and the descriptor never turns
    readable (a lost wakeup): it must still get the message, within the recheck interval."""
    address = f"ipc://{tmp_path}/inbox"
    pull, push = listen(pynng.Pull0, address), dial(pynng.Push0, address)
    waits = []

    async def never_readable(fd: int) -> None:
        waits.append(fd)
        await trio.sleep_forever()

    monkeypatch.setattr(transport.trio.lowlevel, "wait_readable", never_readable)
    try:
        wait_connected(push)

        async def main() -> bytes:
            async def send_later() -> None:
                while not waits:
                    await trio.sleep(0.01)  # the receiver found nothing and is waiting now
                push.send(b"event")

            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_later)
                    return await receive(pull)

        assert trio.run(main) == b"event"
        assert waits, "the receiver never waited: the test did not exercise a lost wakeup"
    finally:
        push.close()
        pull.close()
    assert RECHECK_SECONDS <= 0.5  # a lost wakeup costs a message at most this long


def test_a_request_goes_without_pynng_s_async_send_when_the_pipe_takes_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`send_request` hands a request the pipe can take at once to nng directly: an async send's
    completion would wake the event loop once more for every poll."""
    address = f"ipc://{tmp_path}/client"
    rep, req = listen(pynng.Rep0, address), dial(pynng.Req0, address)

    async def no_async_send(self: pynng.Context, data: bytes) -> None:
        raise AssertionError("the async send was used")

    try:
        wait_connected(req)
        monkeypatch.setattr(pynng.Context, "asend", no_async_send)

        async def main() -> bytes:
            async def answer() -> None:
                ctx = rep.new_context()
                request = await ctx.arecv()
                monkeypatch.undo()  # the reply: a Rep context's, sent as the orchestrator does
                await ctx.asend(b"reply to " + request)
                ctx.close()

            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(answer)
                    ctx = req.new_context()
                    await transport.send_request(ctx, b"poll")
                    reply = await ctx.arecv()
                    ctx.close()
                    return reply

        assert trio.run(main) == b"reply to poll"
    finally:
        req.close()
        rep.close()


def test_a_request_with_no_server_yet_waits_for_one_in_the_async_send(tmp_path) -> None:
    """A pipe that cannot take the message now (no server listens yet) leaves it to the async send,
    which hands it over once one does; nothing is lost."""
    address = f"ipc://{tmp_path}/client"
    req = dial(pynng.Req0, address)
    rep: list[pynng.Socket] = []

    async def main() -> bytes:
        async def serve_later() -> None:
            await trio.sleep(0.3)
            rep.append(listen(pynng.Rep0, address))
            ctx = rep[0].new_context()
            await ctx.asend(b"reply to " + await ctx.arecv())
            ctx.close()

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_later)
                ctx = req.new_context()
                assert not transport._request_now(ctx, b"probe")  # nobody to take it yet
                await transport.send_request(ctx, b"poll")
                reply = await ctx.arecv()
                ctx.close()
                return reply

    try:
        assert trio.run(main) == b"reply to poll"
    finally:
        req.close()
        for sock in rep:
            sock.close()


def test_an_inbox_says_a_message_waits_without_receiving_it(tmp_path) -> None:
    """`Inbox.waiting` polls nng's descriptor: true while a message is queued, false once the queue is
    read empty; it receives nothing itself (the verify lane reads its inbox between forwards only then)."""
    from pipeline.protocol.messages import Close, VerifyInbox, encode
    from pipeline.protocol.transport import Inbox

    address = f"ipc://{tmp_path}/verify"
    inbox, push = Inbox(address, VerifyInbox), dial(pynng.Push0, address)
    try:
        wait_connected(push)
        assert not inbox.waiting() and inbox.ready() == []
        push.send(encode(Close(request_id="r1")))
        deadline = time.monotonic() + 5
        while not inbox.waiting() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert inbox.waiting() and inbox.waiting()  # asking again takes nothing
        assert [m.request_id for m in inbox.ready()] == ["r1"]
        assert not inbox.waiting()
    finally:
        push.close()
        inbox.sock.close()
