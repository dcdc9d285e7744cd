"""Admission control in a real pipeline (one for the module, allowed one running and one waiting
request): a long prompt is tokenized without stalling other streams, an oversized client message
costs only its own connection, and a full queue is refused at once over nng, HTTP and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pynng
import pytest

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import PipelineError
from pipeline.protocol.messages import Submit, encode

from .pipeline_harness import Pipeline, running_pipeline

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    settings = ["admission.max_running=1", "admission.max_queued=1", "speculation.drafter=none"]
    with running_pipeline(tmp_path_factory.mktemp("admission"), settings) as p:
        yield p


def idle(pipeline: Pipeline) -> None:
    pipeline.wait_until(lambda r: r.active_requests == r.queued_requests == 0, what="no request left")


class Stream(threading.Thread):
    """One request read to its end in a thread, noting when each chunk arrived."""

    def __init__(self, pipeline: Pipeline, prompt: str, params: SamplingParams) -> None:
        super().__init__(daemon=True)
        self.client = pipeline.client(timeout=60)
        self.submitted = self.client.submit(prompt, params=params)
        self.request_id = self.submitted.request_id
        self.arrivals: list[float] = []
        self.done: Result | None = None
        self.failed: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.client:
                for item in self.client.chunks(self.request_id):
                    if isinstance(item, Result):
                        self.done = item
                    else:
                        self.arrivals.append(time.monotonic())
        except Exception as exc:
            self.failed = exc

    def cancel(self, pipeline: Pipeline) -> None:
        with pipeline.client() as client:
            client.cancel(self.request_id, secret=self.submitted.secret)  # its owner's secret

    def result(self) -> Result:
        self.join(60)
        assert self.failed is None and self.done is not None, self.failed
        return self.done


def test_a_long_prompt_is_tokenized_while_other_streams_go_on(pipeline: Pipeline):
    idle(pipeline)
    running = Stream(pipeline, "Once upon a time", LONG)
    while len(running.arrivals) < 2:
        time.sleep(0.01)
    prompt = "hello world " * 160_000  # 1.9 MB, under admission.max_message_bytes; seconds to tokenize
    with pipeline.client(timeout=60) as client, pytest.raises(PipelineError) as refused:
        began = time.monotonic()
        try:
            client.call(Submit(prompt=prompt))
        finally:
            ended = time.monotonic()
    assert refused.value.kind == "prompt_too_long"
    running.cancel(pipeline)
    assert running.result().finish_reason == "cancelled"
    # The middle half of the time the orchestrator spent on the long prompt: had it tokenized in
    # its event loop, no chunk could arrive then (only replies sent just before or just after). On an
    # idle machine dozens arrive; on a loaded 2-core one (1 token/s was seen) a single one may.
    quarter = (ended - began) / 4
    assert quarter > 0.1, f"tokenizing took only {ended - began:.2f} s: the test shows nothing"
    during = [t for t in running.arrivals if began + quarter < t < ended - quarter]
    gaps = [b - a for a, b in zip(running.arrivals, running.arrivals[1:], strict=False)]
    assert len(during) >= 1, f"{len(during)} chunks in {2 * quarter:.2f} s; longest gap {max(gaps):.2f} s"


def test_a_client_message_over_the_cap_costs_only_its_connection(pipeline: Pipeline):
    cap = pipeline.config.admission.max_message_bytes
    with pynng.Req0(resend_time=0, recv_timeout=10_000, send_timeout=10_000) as sock:
        sock.dial(pipeline.config.addresses.client, block=True)
        sock.send(encode(Submit(prompt="x" * (cap + 1))))
        started = time.monotonic()
        with pytest.raises(pynng.ConnectionReset):
            sock.recv()
        assert time.monotonic() - started < 5  # dropped at once, never a stall
    with pipeline.client() as client:  # the orchestrator serves on
        done = client.complete("Hello", params=SamplingParams(max_tokens=4))
    assert done.finish_reason in ("length", "stop")
    with pipeline.client() as client:  # a client that knows the cap says why, before sending
        client.max_message_bytes = cap
        with pytest.raises(PipelineError) as caught:
            client.submit("x" * (cap + 1))
    assert caught.value.kind == "too_large" and "admission.max_message_bytes" in caught.value.message


def test_beyond_the_queue_requests_are_refused_over_nng_http_and_the_cli(pipeline: Pipeline):
    idle(pipeline)
    running = Stream(pipeline, "Once upon a time", LONG)
    waiting = Stream(pipeline, "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    report = pipeline.status()
    assert (report.active_requests, report.queued_requests) == (1, 1)
    with pipeline.client() as client, pytest.raises(PipelineError) as caught:
        client.submit("Hi")
    assert caught.value.kind == "overloaded" and "max_queued = 1" in caught.value.message

    body = json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{pipeline.gateway_url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(http.value.read())["error"]
    assert http.value.code == 429 and http.value.headers["Retry-After"] == "1"
    assert error["code"] == "server_overloaded" and "capacity" in error["message"]

    settings = [f"--set={s}" for s in pipeline.settings]
    cli = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "stream", "Hi", "--max-tokens", "4", *settings],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 2 and cli.stderr.startswith("speclanes: error: overloaded: the pipeline is at")
    assert cli.stderr.count("\n") == 1, cli.stderr

    assert not waiting.arrivals  # still waiting its turn
    running.cancel(pipeline)  # a place comes free: the waiting request begins
    assert running.result().finish_reason == "cancelled" and len(waiting.result().tokens) == 8
    assert waiting.arrivals[0] > running.arrivals[-1]  # after the running one, not beside it
