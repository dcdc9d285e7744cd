"""The nng-under-trio transport: a message that arrives while a receiver waits is received even
if nng's poll wakeup for it never comes."""

from __future__ import annotations

import time

import pynng
import pytest
import trio

from pipeline.protocol import transport
from pipeline.protocol.transport import RECHECK_SECONDS, dial, listen, receive


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
        deadline = time.monotonic() + 5
        while not push.pipes and time.monotonic() < deadline:
            time.sleep(0.01)

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
