"""The client-side reading of chunk replies, shared by the blocking and the trio client:
repeats are dropped, and the final object comes only once nothing before it is missing. And the
cap on client messages, as nng enforces it on the orchestrator's socket and the clients before it."""

from __future__ import annotations

import time

import pynng
import pytest
import trio

from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import AsyncClient, Client, PipelineError, continuation, submit_message
from pipeline.protocol.messages import Chunk, Chunks, ErrorReply, Submitted, encode
from pipeline.protocol.transport import listen


def chunks(*seqs: int, done: dict | None = None) -> Chunks:
    return Chunks(request_id="r", chunks=[Chunk(s, f"t{s}", [s]) for s in seqs], done=done)


def test_fresh_chunks_follow_the_last_seen_one():
    fresh, after, done = continuation(chunks(0, 1, 2), -1)
    assert [c.seq for c in fresh] == [0, 1, 2] and after == 2 and done is None
    fresh, after, done = continuation(chunks(1, 2, 3), 1)  # a resend overlapping what was seen
    assert [c.seq for c in fresh] == [2, 3] and after == 3


def test_the_final_object_waits_for_every_chunk_before_it():
    final = {"finish_reason": "stop"}
    assert continuation(chunks(0, 1, done=final), -1)[2] == final
    assert continuation(chunks(done=final), 4)[2] == final  # nothing new: already complete
    fresh, after, done = continuation(chunks(3, 4, done=final), 1)  # 2 is missing
    assert fresh == [] and after == 1 and done is None


def test_submit_message_defaults():
    submit = submit_message("hi", drafter="ngram", k=3)
    assert (submit.prompt, submit.chat, submit.drafter, submit.k) == ("hi", False, "ngram", 3)
    assert submit.params == SamplingParams()


def test_the_trio_client_reports_an_orchestrator_that_does_not_answer(tmp_path):
    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody.ipc", timeout=0.3)
        try:
            with pytest.raises(PipelineError) as caught:
                await client.status()
            assert caught.value.kind == "unavailable" and "nobody.ipc" in caught.value.message
        finally:
            client.close()

    trio.run(main)


def test_the_trio_client_talks_to_a_rep_socket_and_raises_error_replies(tmp_path):
    address = f"ipc://{tmp_path}/rep.ipc"

    async def main() -> None:
        with pynng.Rep0(listen=address) as rep:
            client = AsyncClient(address, timeout=5)

            async def serve() -> None:
                for reply in (
                    Submitted(request_id="abc", prompt_tokens=3),
                    ErrorReply(kind="bad_request", message="no"),
                ):
                    await rep.arecv()
                    await rep.asend(encode(reply))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                assert (await client.submit("hi")).request_id == "abc"
                with pytest.raises(PipelineError) as caught:
                    await client.submit("hi")
                assert (caught.value.kind, caught.value.message) == ("bad_request", "no")
            client.close()

    trio.run(main)


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_a_message_over_the_listener_cap_drops_that_connection_and_the_socket_serves_on(tmp_path, scheme):
    """nng checks a message's length before reading it: the sender gets ConnectionReset at once
    (no stall, nothing held), and the listener answers the next message as usual."""
    address = f"ipc://{tmp_path}/cap.ipc" if scheme == "ipc" else "tcp://127.0.0.1:0"
    with listen(pynng.Rep0, address, max_message_bytes=4096) as rep:
        address = rep.listeners[0].url  # tcp: the port it chose
        with pynng.Req0(resend_time=0, recv_timeout=5000, send_timeout=5000, reconnect_time_min=50) as req:
            req.dial(address, block=True)
            req.send(b"x" * 10_000)
            with pytest.raises(pynng.ConnectionReset):
                req.recv()
            for _ in range(100):  # the dialer reconnects on its own
                try:
                    req.send(b"small")
                    break
                except pynng.NNGException:
                    time.sleep(0.05)
            rep.recv_timeout = 5000
            assert rep.recv() == b"small"
            rep.send(b"ok")
            assert req.recv() == b"ok"


def test_the_clients_refuse_a_message_over_the_orchestrator_cap_before_sending_it(tmp_path):
    big = submit_message("x" * 5000)
    client = Client(f"ipc://{tmp_path}/nobody.ipc", timeout=0.3, max_message_bytes=4096)
    with client, pytest.raises(PipelineError) as caught:
        client.call(big)
    assert caught.value.kind == "too_large" and "admission.max_message_bytes" in caught.value.message

    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody.ipc", timeout=0.3, max_message_bytes=4096)
        try:
            with pytest.raises(PipelineError) as caught:
                await client.call(big)
            assert caught.value.kind == "too_large" and "at most 4096" in caught.value.message
        finally:
            client.close()

    trio.run(main)
