"""Fault rounds with real processes: eight clients stream at once while one process is SIGKILLed
three times (each time once its replacement is up). Nothing is lost or repeated, every stream
equals an undisturbed run token for token, and `audit verify` proves every request. The
gateway's own death ends its streams with an error and frees their requests.

Each kill lands inside the verify lane's run-ahead window: a chunk has just arrived, and the kill
waits a quarter, a half, then three quarters of `run.report_interval_seconds` more, while the lane
holds steps it decided and nobody has journaled or seen. The draft lane's round runs on a pipeline
whose drafts all go through it (`run.draft_in_verify_lane=false`): with the default, the n-gram
drafter drafts in the verify lane, and the draft lane's death would cost no stream anything.

Each round prints the longest stall the clients saw after each kill (pytest -s shows them)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from pipeline.audit.store import AuditStore
from pipeline.audit.verify import verify_request
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import load_model
from pipeline.model.default import default_model_path
from pipeline.model.prompts import prompt_tokens
from pipeline.protocol.messages import StepEvent

from .pipeline_harness import Pipeline, running_pipeline

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a string, then explain it.",
    "Tell me a long story about a lighthouse keeper and a storm.",
    "List five uses of a paperclip.",
    "What is the capital of France? Explain its history.",
]
PARAMS = SamplingParams(max_tokens=120, ignore_eos=True)
CLIENTS = 8
JSON_HEADERS = {"Content-Type": "application/json"}
KILLS = 3


@pytest.fixture(scope="module")
def target():
    return load_model(default_model_path(), "auto")


@pytest.fixture(scope="module")
def references(target) -> dict[str, Result]:
    assert target.tokenizer is not None
    return {
        prompt: decode(
            target, prompt_tokens(target.tokenizer, prompt, chat=True), PARAMS, NoDraftSource(), k=0
        )
        for prompt in PROMPTS
    }


SETTINGS = ["restart.initial_backoff=0.1", "audit.resend_after=0.5", "timeouts.verify=3.0"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    with running_pipeline(tmp_path_factory.mktemp("rounds"), SETTINGS) as p:
        yield p


@pytest.fixture(scope="module")
def paced_pipeline(tmp_path_factory: pytest.TempPathFactory):
    """Drafts through the draft lane, as with a draft model, for the draft lane's own round."""
    settings = [*SETTINGS, "run.draft_in_verify_lane=false"]
    with running_pipeline(tmp_path_factory.mktemp("paced_rounds"), settings) as p:
        yield p


class Streams:
    """Eight clients streaming at once; what each received and when the last chunk arrived."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.chunks: dict[int, list] = {i: [] for i in range(CLIENTS)}
        self.done: dict[int, Result] = {}
        self.ids: dict[int, str] = {}
        self.errors: list[BaseException] = []
        self.last_chunk = time.monotonic()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def emitted(self) -> int:
        return sum(len(c.tokens) for chunks in self.chunks.values() for c in chunks)

    def run(self, i: int) -> None:
        try:
            with self.pipeline.client(timeout=60) as client:
                # A fixed k: the controller prices drafts out of a batch of 8, and the rounds must draft.
                submitted = client.submit(PROMPTS[i % 4], chat=True, params=PARAMS, drafter="ngram", k=4)
                self.ids[i] = submitted.request_id
                for item in client.chunks(submitted.request_id):
                    if isinstance(item, Result):
                        self.done[i] = item
                    else:
                        self.chunks[i].append(item)
                        self.last_chunk = time.monotonic()
        except BaseException as exc:
            self.errors.append(exc)


def kill_rounds(pipeline: Pipeline, streams: Streams, victim: str) -> tuple[list[float], list[int]]:
    """Kill `victim` at a fifth of the way in, twice more once it is back, each time inside the
    run-ahead window (`inside_run_ahead`): the stall after each kill, and the pids killed."""
    stalls, kills, last_pid = [], [], None
    for round_ in range(KILLS):
        while streams.emitted() < (round_ + 1) * CLIENTS * PARAMS.max_tokens // (KILLS + 2):
            assert any(t.is_alive() for t in streams.threads), f"the streams ended before kill {round_ + 1}"
            time.sleep(0.01)
        if last_pid is not None:
            pipeline.wait_lane_up(victim, last_pid, timeout=60)
        last_pid = pipeline.lane(victim).pid
        assert last_pid is not None
        inside_run_ahead(pipeline, streams, (round_ + 1) / (KILLS + 1))
        killed_at = time.monotonic()
        os.kill(last_pid, signal.SIGKILL)
        kills.append(last_pid)
        while streams.last_chunk < killed_at and any(t.is_alive() for t in streams.threads):
            time.sleep(0.005)
        stalls.append(streams.last_chunk - killed_at)
    return stalls, kills


def inside_run_ahead(pipeline: Pipeline, streams: Streams, phase: float) -> None:
    """Returns `phase` of a report interval after the next chunk arrives: the verify lane reports
    its decided steps every interval, so it now holds some that no client has seen."""
    seen = streams.last_chunk
    while streams.last_chunk == seen and any(t.is_alive() for t in streams.threads):
        time.sleep(0.001)
    time.sleep(phase * pipeline.config.run.report_interval_seconds)


@pytest.mark.parametrize("victim", ["verify", "draft", "audit", "orchestrator"])
def test_eight_streams_lose_and_repeat_nothing_through_three_kills(request, references, target, victim):
    pipeline = request.getfixturevalue("paced_pipeline" if victim == "draft" else "pipeline")
    before = pipeline.lane(victim).restarts
    streams = Streams(pipeline)
    for thread in streams.threads:
        thread.start()
    stalls, kills = kill_rounds(pipeline, streams, victim)
    for thread in streams.threads:
        thread.join(240)
    print(f"\n{victim}: stalls after each kill: {', '.join(f'{s:.2f} s' for s in stalls)}")
    assert not streams.errors, streams.errors
    for i in range(CLIENTS):
        chunks, want = streams.chunks[i], references[PROMPTS[i % 4]]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [t for c in chunks for t in c.tokens] == want.tokens == streams.done[i].tokens
        assert "".join(c.text for c in chunks) == want.text
    assert sum(result.stats.drafted for result in streams.done.values()) > 0  # the drafter's lane served

    def settled(report) -> bool:
        lane = next(x for x in report.lanes if x.name == victim)
        return lane.restarts >= before + KILLS and report.audit_pending == 0

    report = pipeline.wait_until(settled, 60, f"{victim} restarted {KILLS} times and the audit outbox empty")
    downs = [f for f in report.faults if f.kind == "lane_down" and f.lane == victim]
    assert {int(f.message.split()[1]) for f in downs} >= set(kills)  # "pid N exited with ..."
    store = AuditStore(pipeline.config.audit.path, readonly=True)
    try:
        for i, request_id in streams.ids.items():
            events = store.events(request_id)
            steps = sorted(e.step for e in events if isinstance(e, StepEvent))
            assert steps == list(range(streams.done[i].stats.steps + 1)), "every step recorded once"
            verdict = verify_request(request_id, events, target, None)
            assert verdict.verdict == "pass", (request_id, verdict.problems, verdict.failed_steps)
    finally:
        store.close()


def gateway_round(pipeline: Pipeline, body: bytes) -> tuple[float, dict[int, str]]:
    """Eight SSE streams through the gateway, then SIGKILL it: how long until their requests were
    freed, and how each stream ended."""
    outcomes: dict[int, str] = {}
    started = threading.Barrier(CLIENTS + 1, timeout=120)

    def stream(i: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", pipeline.config.gateway.port, timeout=120)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            response.readline()  # the first event: the stream is running
            started.wait()
            while line := response.readline():
                if line.strip() == b"data: [DONE]":
                    outcomes[i] = "done"
                    return
            outcomes[i] = "cut off"
        except (http.client.HTTPException, OSError) as exc:
            outcomes[i] = f"error: {type(exc).__name__}"
        finally:
            connection.close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    started.wait()
    assert pipeline.status().active_requests == CLIENTS
    gateway = pipeline.lane("gateway").pid
    assert gateway is not None
    killed_at = time.monotonic()
    os.kill(gateway, signal.SIGKILL)
    pipeline.wait_until(lambda r: r.active_requests == 0, 10, "the dead gateway's requests freed")
    freed_after = time.monotonic() - killed_at
    for thread in threads:
        thread.join(30)
    pipeline.wait_until(lambda r: r.lane("verify").active_requests == 0)
    pipeline.wait_lane_up("gateway", gateway, timeout=60)
    return freed_after, outcomes


def test_a_dead_gateway_ends_its_streams_with_an_error_and_frees_their_requests(pipeline):
    body = json.dumps(
        {
            "model": pipeline.config.model_id(), "prompt": PROMPTS[1], "max_tokens": 2000, "stream": True,
            "ignore_eos": True,  # none of them may end before the kill
        }
    ).encode()  # fmt: skip
    pipeline.wait_lane_up("gateway", None, timeout=60)
    for round_ in range(KILLS):
        freed_after, outcomes = gateway_round(pipeline, body)
        print(
            f"\ngateway kill {round_ + 1}: its {CLIENTS} requests freed {freed_after:.2f} s after; {outcomes}"
        )
        assert len(outcomes) == CLIENTS and "done" not in outcomes.values(), outcomes


def test_gateway_streams_repeat_and_lose_nothing_when_the_orchestrator_dies(pipeline, references):
    """SSE streams through the gateway (their chunks pushed onto its inbox, subscribed by one `Watch`)
    while the orchestrator is SIGKILLed: the closed pipe and the retried watch subscribe them again
    with the new one, and every stream's text is the undisturbed run's, each token once."""
    pipeline.wait_lane_up("gateway", None, timeout=60)
    pipeline.wait_lane_up("orchestrator", None, timeout=60)
    streams = 4
    texts: dict[int, str] = {}
    errors: list[BaseException] = []
    events = [0]

    def stream(i: int) -> None:
        body = {
            "model": pipeline.config.model_id(), "messages": [{"role": "user", "content": PROMPTS[i]}],
            "max_tokens": PARAMS.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", pipeline.config.gateway.port, timeout=120)
        try:
            connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(), JSON_HEADERS)
            response, pieces = connection.getresponse(), []
            assert response.status == 200
            while line := response.readline():
                if line.startswith(b"data: {"):
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    pieces += [choice["delta"].get("content") or "" for choice in payload["choices"]]
                    events[0] += 1
            texts[i] = "".join(pieces)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    while events[0] < 4 * streams and any(t.is_alive() for t in threads):
        time.sleep(0.01)
    orchestrator = pipeline.lane("orchestrator").pid
    assert orchestrator is not None and all(t.is_alive() for t in threads), "the streams ended first"
    os.kill(orchestrator, signal.SIGKILL)
    for thread in threads:
        thread.join(240)
    assert not errors, errors
    want = {i: references[PROMPTS[i]].text for i in range(streams)}
    assert {i: texts.get(i) for i in range(streams)} == want
    pipeline.wait_lane_up("orchestrator", orchestrator, timeout=60)
