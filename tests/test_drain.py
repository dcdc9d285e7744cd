"""SIGTERM drains: with 8 HTTP streams in flight, nothing new is admitted, what is in flight
finishes within the window, and what is left when it ends gets an error event and [DONE].

Real processes: a supervisor with every lane and the HTTP gateway, streams read as raw SSE (so an
error event is seen as a client sees it), SIGTERM to the supervisor once every stream has its
first tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from pipeline.api.errors import pipeline_error
from pipeline.api.health import judge
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.orchestration.journal import Journal
from pipeline.protocol.messages import LaneStatus, SpeculativeState
from pipeline.service.supervisor import DRAIN_CUT_EXIT

from .pipeline_harness import Pipeline

PROMPTS = (
    "Write a short story about a lighthouse keeper and a lost seagull.",
    "Explain how the gears on a bicycle make pedalling easier on hills.",
    "List five practical tips for learning a new language as an adult.",
    "Describe the water cycle to a ten-year-old.",
)


def test_draining_is_a_503_with_retry_after_and_health_says_why():
    error = pipeline_error("draining", "the pipeline is shutting down (SIGTERM)")
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert error.body()["error"]["code"] == "server_shutting_down"
    up = [
        LaneStatus(name=name, state="up", pid=1, restarts=0, active_requests=0, totals=SpeculativeState())
        for name in ("orchestrator", "verify")
    ]
    assert judge(up, "SIGTERM").reason() == "draining: the pipeline is shutting down (SIGTERM)"
    assert judge(up).reason() is None


class Stream(threading.Thread):
    """One streamed chat completion, read as raw server-sent events."""

    def __init__(self, url: str, model: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.started = url, threading.Event()
        self.body = {
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        self.events: list[Any] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with urllib.request.urlopen(
                post(f"{self.url}/v1/chat/completions", self.body), timeout=120
            ) as reply:
                for raw in reply:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if any(isinstance(e, dict) and e.get("choices") for e in self.events[1:]):
                            self.started.set()
        except BaseException as exc:
            self.failure = exc
        finally:
            self.started.set()

    def text(self) -> str:
        chunks = [e for e in self.events if isinstance(e, dict) and e.get("choices")]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)

    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )


def fetch(request: urllib.request.Request | str) -> tuple[int, dict[str, str], dict]:
    """Status, headers (names in lower case) and JSON body, whatever the status."""
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            status, headers, body = reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as exc:
        status, headers, body = exc.code, exc.headers, exc.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(body)


def streams_then_sigterm(pipeline: Pipeline, max_tokens: int) -> list[Stream]:
    model = pipeline.config.model_id()
    streams = [Stream(pipeline.gateway_url, model, PROMPTS[i % 4], max_tokens) for i in range(8)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60)
    assert pipeline.proc is not None
    pipeline.proc.send_signal(signal.SIGTERM)
    return streams


@pytest.mark.slow
def test_with_a_long_enough_window_every_stream_completes_unchanged_and_the_exit_is_0(tmp_path, served_model):
    pipeline = Pipeline(tmp_path / "run", ["shutdown.drain_seconds=60"])
    pipeline.start()
    try:
        streams = streams_then_sigterm(pipeline, max_tokens=48)
        time.sleep(0.3)  # the notice has reached the orchestrator: new work is refused meanwhile
        refused = fetch(post(f"{pipeline.gateway_url}/v1/chat/completions", streams[0].body))
        health = fetch(f"{pipeline.gateway_url}/health")
        for stream in streams:
            stream.join(120)
        assert pipeline.proc.wait(90) == 0
    finally:
        pipeline.stop()
    assert refused[0] == 503 and refused[1]["retry-after"] == "1"
    assert refused[2]["error"]["code"] == "server_shutting_down"
    assert health[0] == 503 and "draining" in health[2]["reason"]
    for i, stream in enumerate(streams):
        assert stream.failure is None and stream.errors() == [] and stream.events[-1] == "[DONE]"
        tokens = served_model.tokenizer.encode(
            served_model.tokenizer.render_chat([{"role": "user", "content": PROMPTS[i % 4]}])
        )
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        want = decode(served_model, tokens, params, make_draft_source("none", served_model, None), k=0)
        assert stream.text() == want.text, i


@pytest.mark.slow
def test_with_a_1_s_window_every_stream_ends_with_an_error_and_done_and_none_is_resumed(tmp_path):
    run = tmp_path / "run"
    pipeline = Pipeline(run, ["shutdown.drain_seconds=1"])
    pipeline.start()
    try:
        streams = streams_then_sigterm(pipeline, max_tokens=4000)
        for stream in streams:
            stream.join(60)
        assert pipeline.proc.wait(60) == DRAIN_CUT_EXIT  # a forced drain is not a clean stop
    finally:
        pipeline.stop()
    for stream in streams:
        assert stream.failure is None and stream.events[-1] == "[DONE]"
        assert [e["code"] for e in stream.errors()] == ["server_shutdown"]
    assert "ended 8 unfinished requests" in (run / "supervisor.log").read_text()
    again = Pipeline(run, [])
    again.start()
    try:
        time.sleep(1.0)
        report = again.status()
        assert report.active_requests + report.queued_requests == 0  # the next start resumes none
    finally:
        again.stop()


@pytest.mark.slow
def test_after_a_supervisor_sigkill_the_http_streams_requests_are_cancelled_within_10_s(tmp_path):
    """The supervisor and all its processes are SIGKILLed at once (as the OOM killer or a lost
    container would) with 8 HTTP streams in flight, the orchestrator first, so no gateway is left
    to cancel them. The next start recovers the requests from the journal, and cancels them once its
    own gateway is up: theirs is gone."""
    run = tmp_path / "run"
    pipeline = Pipeline(run, [])
    pipeline.start()
    streams = [
        Stream(pipeline.gateway_url, pipeline.config.model_id(), PROMPTS[i % 4], 4000) for i in range(8)
    ]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60)
    assert pipeline.proc is not None
    pids = {lane.name: lane.pid for lane in pipeline.status().lanes if lane.pid}
    # the orchestrator first, so that no gateway can still cancel its streams there; then the rest
    for pid in [pids.pop("orchestrator"), *pids.values(), pipeline.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    pipeline.proc.wait()
    for stream in streams:
        stream.join(30)
    recovered = Journal(run / "journal.sqlite").recover().requests
    assert sum(r.result is None for r in recovered) == 8  # nothing had the time to cancel them
    again = Pipeline(run, [])
    again.start()
    try:
        began = time.monotonic()
        report = again.wait_until(
            lambda r: r.active_requests + r.queued_requests == 0, timeout=10, what="the orphans cancelled"
        )
        print(f"orphaned requests cancelled {time.monotonic() - began:.1f} s after the restart was up")
        assert report.lanes
    finally:
        again.stop()
