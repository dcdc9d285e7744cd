"""The client-side reading of chunk replies, shared by the blocking and the trio client:
repeats are dropped, and the final object comes only once nothing before it is missing."""

from __future__ import annotations

import pynng
import pytest
import trio

from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import AsyncClient, PipelineError, continuation, submit_message
from pipeline.protocol.messages import Chunk, Chunks, ErrorReply, Submitted, encode


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
