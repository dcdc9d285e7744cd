"""The pipeline as users run it: real processes, real sockets, the real default model.

One pipeline serves the whole module (lanes are killed and restarted inside it: that is
what it must survive); the supervisor tests start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import cache

import jsonschema
import msgspec
import pynng
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.audit.verify import verify_request
from pipeline.bench.common import WORKLOADS
from pipeline.decoding.drafters.kinds import needs_head
from pipeline.decoding.drafters.registry import DRAFTERS, make_draft_source
from pipeline.decoding.grammar.format import canonical_response_format
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import default_model_path
from pipeline.model.prompts import prompt_tokens
from pipeline.protocol.client import PipelineError
from pipeline.protocol.config import load_config
from pipeline.protocol.messages import (
    AuditAck,
    ClientReply,
    Codec,
    DraftRequest,
    ErrorReply,
    Heartbeat,
    Open,
    SpeculativeState,
    StatusQuery,
    StepEvent,
    Submit,
    Verify,
    encode,
)
from pipeline.protocol.transport import dial
from pipeline.workers.loop_phases import LoopPhase

from .pipeline_harness import Pipeline, alive, free_port, running_pipeline

pytestmark = pytest.mark.slow

CODE = "Write a Python function that reverses a string, then explain it."
STORY = "Tell me a long story about a lighthouse keeper and a storm."
PROMPTS = [
    CODE,
    STORY,
    "List five uses of a paperclip.",
    "What is the capital of France? Explain its history.",
]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    settings_ = [
        f"model.draft_path={default_model_path()}",  # the target drafts for itself: exercises the model lane
        "timeouts.client_idle=2.0",
        # A draft that times out turns its step into plain decoding, which spends other uniforms:
        # seeded sampling stays exact in distribution but no longer reproduces the in-process run.
        # A loaded machine (CI shares 2 cores) must not turn the model drafter's drafts into timeouts.
        "timeouts.draft=30.0",
        "restart.initial_backoff=0.1",
        "audit.resend_after=0.5",
        # Decided steps reach the orchestrator after every forward here, with no pause (other pipelines
        # in the suite send them in batches every 20 ms): every test of this module holds either way.
        "run.report_interval_seconds=0",
        "run.report_pause_seconds=0",
    ]
    with running_pipeline(tmp_path_factory.mktemp("run"), settings_) as p:
        yield p


@cache
def _served_model():
    from pipeline.model import load_model

    return load_model(default_model_path())  # the backend the pipeline serves with (auto)


@cache
def _head():
    """The draft head the pipeline finds for the default model (`model.draft_head` is empty), if any."""
    from pipeline.model.draft_head import head_for

    model = _served_model()
    return head_for(default_model_path(), model.cfg, model.embed)


@cache
def _reference(prompt: str, params: SamplingParams, drafter: str, k: int | None):
    model = _served_model()
    assert model.tokenizer is not None
    tokens = prompt_tokens(model.tokenizer, prompt, chat=True)
    source = make_draft_source(drafter, model, model if drafter == "model" else None, _head())
    return decode(model, tokens, params, source, k=0 if drafter == "none" else k)


def read_stream(client, request_id: str, after: int = -1, on_chunk=None):
    chunks, done = [], None
    for item in client.chunks(request_id, after=after):
        if isinstance(item, Result):
            done = item
        else:
            chunks.append(item)
            if on_chunk is not None:
                on_chunk(chunks)
    return chunks, done


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_output_equals_in_process_generation(pipeline: Pipeline, drafter: str) -> None:
    params = SamplingParams(max_tokens=40)
    k = 4 if drafter == "model" else None  # self-drafting at large k would outrun the draft timeout
    if needs_head(drafter) and _head() is None:  # no head for the default model here: refused, saying why
        with pipeline.client() as client, pytest.raises(PipelineError, match="needs a draft head") as info:
            client.complete(CODE, chat=True, params=params, drafter=drafter, k=k)
        assert info.value.kind == "bad_request"
        return
    with pipeline.client() as client:
        done = client.complete(CODE, chat=True, params=params, drafter=drafter, k=k)
    ref = _reference(CODE, params, drafter, k)
    assert done.tokens == ref.tokens
    assert done.text == ref.text
    assert done.finish_reason == ref.finish_reason
    assert done.request_id and done.stats.drafter == drafter


# Not seeded `auto`: this pipeline's auto falls back to the model drafter, not seed-exact.
@pytest.mark.parametrize(("temperature", "drafter"), [(0.0, "auto"), (0.7, "suffix")])
def test_token_trees_are_verified_through_the_lanes_and_audited(
    pipeline: Pipeline, temperature: float, drafter: str
) -> None:
    """The code-edit workload, whose n-grams recur with several continuations: the draft lane
    proposes trees (8 nodes a step), the verify lane verifies them in its batched forwards, the
    output is plain decoding's (seed for seed), and the audit trail's tree steps verify."""
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=64)
    with pipeline.client() as client:
        done = client.complete(WORKLOADS["code"], chat=True, params=params, drafter=drafter, k=8)
    assert done.tokens == _reference(WORKLOADS["code"], params, "none", 0).tokens
    events = pipeline.events(done.request_id)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert any(s.parents is not None and len(set(s.parents)) < len(s.parents) for s in steps)
    assert verify_request(done.request_id, events, _served_model(), None).verdict == "pass"


# Each position is sampled with its own number (seed, position): the deterministic drafters give
# plain seeded decoding's tokens whatever they drafted (the suffix drafter learns across requests
# in the lane, so what it drafts depends on history; the output does not), and the model drafter
# gives the in-process run's. Not `auto`: this pipeline's auto includes the model drafter.
@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix", "model"])
def test_seeded_sampling_equals_in_process_generation(pipeline: Pipeline, drafter: str) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40)
    with pipeline.client() as client:
        done = client.complete(STORY, chat=True, params=params, drafter=drafter, k=4)
    ref = _reference(STORY, params, "model" if drafter == "model" else "none", 4)
    assert done.tokens == ref.tokens
    assert done.stats.seed == 11


# Greedy kills of every lane and of the orchestrator, eight clients at a time, are in
# tests/test_crash_rounds.py; here one seeded request with the cross-request drafter, long enough
# that it still runs when the restarted lane is back for its second kill: still plain seeded
# decoding's tokens.
@pytest.mark.parametrize(
    ("lane", "params", "drafter"),
    [("verify", SamplingParams(temperature=0.8, seed=5, max_tokens=400, ignore_eos=True), "suffix")],
    ids=["verify-seeded"],
)
def test_lane_killed_twice_mid_stream_loses_and_repeats_nothing(
    pipeline: Pipeline, lane: str, params: SamplingParams, drafter: str
) -> None:
    ref = _reference(STORY, params, "none", 0)
    before = pipeline.lane(lane)
    kills: list[int] = []
    emitted = [0]

    def killer() -> None:
        """Kill the lane at 15 and at 60 tokens; the second time only once it is back up."""
        for threshold in (15, 60):
            while emitted[0] < threshold:
                time.sleep(0.01)
            if kills:
                pipeline.wait_lane_up(lane, kills[-1])
            pid = pipeline.lane(lane).pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)

    def count(chunks) -> None:
        emitted[0] = sum(len(c.tokens) for c in chunks)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pipeline.client() as client:
        request_id = client.submit(STORY, chat=True, params=params, drafter=drafter).request_id
        chunks, done = read_stream(client, request_id, on_chunk=count)
    assert done.error is None, done
    assert len(kills) == 2
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [t for c in chunks for t in c.tokens] == ref.tokens
    assert "".join(c.text for c in chunks) == ref.text == done.text

    def recovered(report) -> bool:
        view = next(x for x in report.lanes if x.name == lane)
        return view.state == "up" and view.restarts >= before.restarts + 2 and report.audit_pending == 0

    report = pipeline.wait_until(recovered, what=f"{lane} restarted twice and the audit outbox empty")
    downs = [f for f in report.faults if f.kind == "lane_down" and f.lane == lane]
    assert {int(f.message.split()[1]) for f in downs} >= set(kills)
    rows = pipeline.audit_rows(request_id)
    steps = [step for _, step, kind in rows if kind == "StepEvent"]
    assert steps == list(range(done.stats.steps + 1))  # every step once, the prefill as step 0
    assert sorted(kind for _, _, kind in rows if kind != "StepEvent") == ["RequestOpened", "SpeculativeEvent"]


STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "lines": {
            "type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 2, "maxItems": 2,
        },
    },
    "required": ["title", "lines"],
    "additionalProperties": False,
}  # fmt: skip


def test_a_verify_lane_killed_mid_stream_of_a_structured_request_changes_nothing(pipeline: Pipeline) -> None:
    """SIGKILL the verify lane a few tokens into a seeded json_schema request: the restarted lane is
    re-primed (its grammar walked through the output and the pending token), and the client gets plain
    seeded constrained decoding's tokens, which validate; the audit trail verifies."""
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}
    params = SamplingParams(
        temperature=0.7, seed=9, max_tokens=200, response_format=canonical_response_format(fmt)
    )
    ref = _reference(STORY, params, "none", 0)
    before = pipeline.lane("verify")
    killed: list[int] = []  # the token count the client had seen when the lane died
    emitted = [0]

    def killer() -> None:
        while emitted[0] < 5:
            time.sleep(0.01)
        pid = pipeline.lane("verify").pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed.append(emitted[0])

    def count(chunks) -> None:
        emitted[0] = sum(len(c.tokens) for c in chunks)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pipeline.client() as client:
        request_id = client.submit(STORY, chat=True, params=params, drafter="suffix").request_id
        chunks, done = read_stream(client, request_id, on_chunk=count)
    assert done.error is None and killed and killed[0] < len(ref.tokens) - 10, (done, killed)  # mid-stream
    assert [t for c in chunks for t in c.tokens] == ref.tokens and done.text == ref.text
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), STORY_SCHEMA)
    pipeline.wait_until(
        lambda r: r.lane("verify").restarts > before.restarts and r.audit_pending == 0,
        what="the verify lane restarted and the audit outbox empty",
    )
    assert verify_request(request_id, pipeline.events(request_id), _served_model(), None).verdict == "pass"


def test_a_client_that_disconnects_frees_its_request(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    client = pipeline.client()
    submitted = client.submit(STORY, chat=True, params=params, drafter="none")
    request_id = submitted.request_id
    for item in client.chunks(request_id):
        if not isinstance(item, Result) and item.seq >= 3:
            break
    client.close()  # gone without a word

    def freed(report) -> bool:
        verify = report.lane("verify")
        return report.active_requests == 0 and verify.active_requests == 0

    pipeline.wait_until(freed, timeout=20, what="the abandoned request to be freed")
    with pipeline.client() as client:
        *_, done = client.chunks(request_id, after=10**6, secret=submitted.secret)
    assert done.finish_reason == "cancelled"
    assert len(done.tokens) < 1000


def test_a_resumed_stream_gets_the_rest_exactly_once(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = _reference(CODE, params, "none", 0)
    first = pipeline.client()
    submitted = first.submit(CODE, chat=True, params=params, drafter="ngram")
    request_id = submitted.request_id
    seen = []
    for item in first.chunks(request_id):
        assert not isinstance(item, Result)
        seen.append(item)
        if sum(len(c.tokens) for c in seen) >= 10:
            break
    first.close()
    with pipeline.client() as second:  # a new connection, as after a network failure
        second.secrets.keep(submitted)  # the secret the first connection was given
        rest, done = read_stream(second, request_id, after=seen[-1].seq)
    chunks = seen + rest
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == ref.text
    assert [t for c in chunks for t in c.tokens] == ref.tokens == done.tokens


# Not `auto` here: this pipeline's auto includes the self-drafting model (slow by design).
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_eight_concurrent_clients_all_get_their_own_correct_output(pipeline: Pipeline, drafter: str) -> None:
    params = SamplingParams(max_tokens=32)
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with pipeline.client(timeout=60) as client:
                results[i] = client.complete(PROMPTS[i % 4], chat=True, params=params, drafter=drafter)
        except BaseException as exc:
            errors.append(exc)

    batches_before = pipeline.lane("verify").totals
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == 8
    for i, done in results.items():
        assert done.tokens == _reference(PROMPTS[i % 4], params, "none", 0).tokens

    def counted(report) -> bool:
        """The verify lane's totals (sent with its heartbeats) once they count all 8 requests' forwards:
        it opened all 8 and has closed them. The orchestrator can see them done a heartbeat earlier."""
        verify = report.lane("verify").totals
        return verify.active_requests == 0 and verify.runs >= batches_before.runs + 8

    after = pipeline.wait_until(counted, what="the verify lane's totals").lane("verify").totals
    rows = after.batched_rows - batches_before.batched_rows
    assert rows / (after.batches - batches_before.batches) > 1.5  # several requests shared forwards


def test_max_iterations_ends_the_request_with_that_fault(pipeline: Pipeline) -> None:
    with pipeline.client() as client:
        done = client.complete(CODE, chat=True, params=SamplingParams(max_tokens=50), max_iterations=3)
    assert done.finish_reason == "max_iterations_exceeded"
    assert done.stats.steps == 3
    faults = pipeline.status().faults
    assert any(f.kind == "max_iterations_exceeded" and f.request_id == done.request_id for f in faults)


@pytest.mark.parametrize(
    ("submit", "kind"),
    [
        (Submit(prompt="x" * 40_000), "prompt_too_long"),
        (Submit(prompt=""), "bad_request"),
        (Submit(prompt="hi", drafter="oracle"), "bad_request"),
        (Submit(prompt="hi", k=99), "bad_request"),
        (Submit(messages=[{"role": "user"}]), "bad_request"),
        (Submit(), "bad_request"),
    ],
)
def test_bad_requests_get_a_clear_error(pipeline: Pipeline, submit: Submit, kind: str) -> None:
    with pipeline.client() as client, pytest.raises(PipelineError) as info:
        client.call(submit)
    assert info.value.kind == kind and info.value.message


def test_invalid_settings_are_refused_by_name(pipeline: Pipeline) -> None:
    raw = msgspec.msgpack.encode({"type": "Submit", "prompt": "hi", "params": {"temperature": -1}})
    reply = _raw_client_call(pipeline, raw)
    assert isinstance(reply, ErrorReply) and reply.kind == "bad_request" and "temperature" in reply.message


def _raw_client_call(pipeline: Pipeline, data: bytes):
    with pynng.Req0(dial=pipeline.config.addresses.client, recv_timeout=10_000, send_timeout=10_000) as sock:
        sock.send(data)
        return Codec(ClientReply).decode(sock.recv())


def _crafted(vocab: int) -> list[bytes]:
    params = SamplingParams()
    return [
        encode(Verify(request_id="nobody", step=5, position=3, pending=1)),
        encode(Verify(request_id="nobody", step=1, position=0, pending=vocab + 7)),
        encode(Open(request_id="bad-open", step=0, tokens=[vocab + 1], params=params, seed=1)),
        encode(Open(request_id="empty-open", step=0, tokens=[], params=params, seed=1)),
        encode(
            DraftRequest(
                request_id="d",
                step=1,
                drafter="ngram",
                params=params,
                seed=1,
                prompt_length=1,
                context=[1],
                k=999,
            )
        ),
        encode(
            DraftRequest(
                request_id="d",
                step=1,
                drafter="nope",
                params=params,
                seed=1,
                prompt_length=1,
                context=[1],
                k=2,
            )
        ),
        encode(Heartbeat(lane="phantom", pid=1, state=SpeculativeState())),
        encode(AuditAck(event_ids=["not-an-event"])),
        encode(Submit(prompt="wrong socket")),
        msgspec.msgpack.encode({"type": "Verify", "version": 99, "request_id": "x", "step": 1}),
        msgspec.msgpack.encode({"type": "NoSuchMessage"}),
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blobs=st.lists(st.binary(max_size=4096), min_size=1, max_size=4))
def test_fuzzed_client_socket_answers_every_garbage_with_an_error(
    pipeline: Pipeline, blobs: list[bytes]
) -> None:
    for blob in blobs:
        reply = _raw_client_call(pipeline, blob)
        assert isinstance(reply, ErrorReply) and reply.kind == "bad_request"


def test_garbage_on_every_socket_disturbs_no_lane_and_no_request(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = _reference(CODE, params, "none", 0)
    before = {lane.name: (lane.pid, lane.restarts) for lane in pipeline.status().lanes}
    outcome: dict = {}

    def stream() -> None:
        with pipeline.client(timeout=60) as client:
            outcome["done"] = client.complete(CODE, chat=True, params=params, drafter="auto")

    worker = threading.Thread(target=stream)
    worker.start()
    rng = random.Random(1234)
    garbage = [b"", b"\x00", b"\xff" * 7, rng.randbytes(100), rng.randbytes(70_000)]
    garbage += [rng.randbytes(rng.randint(1, 3000)) for _ in range(20)]
    garbage += _crafted(49152)
    addresses = pipeline.config.addresses
    for address in (addresses.verify, addresses.draft, addresses.audit, addresses.data, addresses.control):
        with pynng.Push0(dial=address, send_timeout=5000) as sock:
            for blob in garbage:
                sock.send(blob)
            time.sleep(0.2)  # let the queue drain before the socket closes
    worker.join(120)
    assert outcome["done"].tokens == ref.tokens
    report = pipeline.status()
    assert {lane.name: (lane.pid, lane.restarts) for lane in report.lanes} == before
    assert all(lane.state == "up" for lane in report.lanes)
    reporters = {f.lane for f in report.faults if f.kind == "bad_request"}
    assert {"verify", "draft", "audit", "orchestrator"} <= reporters
    with pipeline.client() as client:  # and the pipeline still serves
        assert client.complete(CODE, chat=True, params=params, drafter="ngram").tokens == ref.tokens


def _supervisor_and_children(tmp_path) -> tuple[Pipeline, list[int]]:
    p = Pipeline(tmp_path / "run", ["restart.shutdown_grace=2.0"])
    p.start()
    report = p.wait_until(lambda r: all(lane.pid for lane in r.lanes))
    return p, [lane.pid for lane in report.lanes if lane.pid]


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_sigterm_shuts_everything_down(tmp_path) -> None:
    p, children = _supervisor_and_children(tmp_path)
    assert p.proc is not None
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(20) == 0
    assert _wait_gone(children) == []
    assert not (p.run_dir / "supervisor.pid").exists()


def test_a_killed_supervisor_leaves_no_orphans(tmp_path) -> None:
    p, children = _supervisor_and_children(tmp_path)
    assert p.proc is not None
    p.proc.kill()
    p.proc.wait()
    assert _wait_gone(children) == []


@contextlib.contextmanager
def _two_hosts(
    tmp_path, shared: list[str], only_a: list[str], only_b: list[str]
) -> Iterator[tuple[Pipeline, Pipeline]]:
    """The multi-host layout on loopback: host A's supervisor runs the orchestrator, draft and audit
    lanes, host B's the verify lane; both started, neither waited for."""
    host_a = Pipeline(tmp_path / "a", [*shared, *only_a, 'run.components=["orchestrator", "draft", "audit"]'])
    host_b = Pipeline(tmp_path / "b", [*shared, *only_b, 'run.components=["verify"]'])
    try:
        for host in (host_a, host_b):
            command = [sys.executable, "-m", "pipeline.cli", "start", *(f"--set={s}" for s in host.settings)]
            host.run_dir.mkdir(parents=True)
            log = (host.run_dir / "supervisor.log").open("ab")
            host.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        yield host_a, host_b
    finally:
        host_a.stop()
        host_b.stop()


def _serves_across_hosts(host_a: Pipeline, host_b: Pipeline) -> None:
    params = SamplingParams(max_tokens=24)
    with host_a.client() as client:
        client.wait_ready(90)
        done = client.complete(CODE, chat=True, params=params, drafter="ngram")
    assert done.tokens == _reference(CODE, params, "none", 0).tokens

    # The lane's totals reach the orchestrator with its next heartbeat, not with the reply.
    def verify_counted(report) -> bool:
        verify = report.lane("verify")
        return verify.pid is not None and verify.totals.runs >= 1

    host_a.wait_until(verify_counted, timeout=10, what="the verify lane's heartbeat to count the run")
    assert not (host_a.run_dir / "verify.log").exists() and (host_b.run_dir / "verify.log").exists()


def test_two_hosts_over_tcp(tmp_path) -> None:
    """Plain tcp:// on loopback, which needs no [tls]."""
    names = ("client", "control", "data", "verify", "draft", "audit")
    shared = [f"addresses.{name}=tcp://127.0.0.1:{free_port()}" for name in names]
    with _two_hosts(tmp_path, shared, [], []) as hosts:
        _serves_across_hosts(*hosts)


def test_two_hosts_over_mutual_tls(tmp_path) -> None:
    """As the multi-host example runs: every address tls+tcp://, host A's certificate for 127.0.0.1,
    host B's (the verify lane) for 127.0.0.2, one CA. A peer without a certificate from that CA gets
    no status report from the client socket, and nothing it sends to a data inbox arrives."""
    from pipeline.service.certs import host_files, make

    make(tmp_path / "certs", ["127.0.0.1", "127.0.0.2"])
    make(tmp_path / "other", ["127.0.0.1"])

    def tls(directory: str, host: str) -> list[str]:
        cert, key = host_files(tmp_path / directory, host)
        return [
            f"tls.ca_file={tmp_path / directory / 'ca.pem'}",
            f"tls.cert_file={cert}",
            f"tls.key_file={key}",
        ]

    names = ("client", "control", "data", "verify", "draft", "audit")
    shared = [f"addresses.{n}=tls+tcp://127.0.0.{2 if n == 'verify' else 1}:{free_port()}" for n in names]
    with _two_hosts(tmp_path, shared, tls("certs", "127.0.0.1"), tls("certs", "127.0.0.2")) as (
        host_a,
        host_b,
    ):
        _serves_across_hosts(host_a, host_b)
        addresses = host_a.config.addresses
        intruders = [
            load_config(None, [*shared, *tls("other", "127.0.0.1")], environ={}).tls,  # another CA
            pynng.TLSConfig(  # trusts the pipeline's CA, shows no certificate
                pynng.TLSConfig.MODE_CLIENT, server_name="127.0.0.1", ca_files=[host_a.config.tls.ca_file],
                auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
            ),
            None,  # plain tcp:// to the TLS port
        ]  # fmt: skip
        for intruder in intruders:
            _refused(addresses, intruder)
        assert not [f for f in host_a.status().faults if f.kind == "bad_request"]
        # The control: the same garbage from a holder of the pipeline's certificate does arrive.
        with dial(pynng.Push0, addresses.data, host_b.config.tls) as lane:
            lane.send_timeout = 5000
            lane.send(b"\xff" * 7)
            time.sleep(0.2)  # let it go before the socket closes
        host_a.wait_until(
            lambda r: any(f.kind == "bad_request" and f.lane == "orchestrator" for f in r.faults),
            timeout=10, what="the orchestrator to report the lane's garbage",
        )  # fmt: skip


def _refused(addresses, intruder) -> None:
    """An intruder's status query gets no answer; its garbage for the data inbox never gets a pipe."""
    from pipeline.protocol.config import Tls

    def socket(kind, address: str):
        if isinstance(intruder, Tls):
            return dial(kind, address, intruder)
        plain = address.replace("tls+tcp://", "tcp://") if intruder is None else address
        sock = kind(tls_config=intruder) if intruder is not None else kind()
        sock.dial(plain, block=False)
        return sock

    with socket(pynng.Req0, addresses.client) as client:
        client.send_timeout = client.recv_timeout = 1500
        with pytest.raises(pynng.Timeout):
            client.send(encode(StatusQuery()))
            client.recv()
        assert not client.pipes
    with socket(pynng.Push0, addresses.data) as push:
        push.send_timeout = 1500
        with contextlib.suppress(pynng.Timeout):
            push.send(b"\xff" * 7)
        time.sleep(0.3)
        assert not push.pipes


def test_the_readme_commands_start_stream_status_stop(tmp_path) -> None:
    """start --detach; stream --json (the generate --json object plus request_id); status --json; stop."""
    import json

    # The gateway's own port: 8000 may be taken on this machine (another pipeline, another server).
    env = {**os.environ, "SPECLANES_RUN_DIR": str(tmp_path / "run")}
    env["SPECLANES_GATEWAY_PORT"] = str(free_port())

    def speclanes(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pipeline.cli", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    started = speclanes("start", "--detach")
    assert started.returncode == 0, started.stderr
    try:
        prompt = ["--chat", CODE, "--max-tokens", "20"]
        streamed = speclanes("stream", *prompt, "--json", "--drafter", "ngram")
        generated = speclanes("generate", *prompt, "--json", "--drafter", "ngram")
        assert streamed.returncode == 0, streamed.stderr
        got, want = json.loads(streamed.stdout), json.loads(generated.stdout)
        assert set(got) == {*want, "request_id"}
        assert (got["tokens"], got["text"], got["finish_reason"]) == (
            want["tokens"],
            want["text"],
            want["finish_reason"],
        )
        plain = speclanes("stream", *prompt)
        assert plain.stdout == want["text"] + "\n"
        status = json.loads(speclanes("status", "--json").stdout)
        assert {lane["name"]: lane["state"] for lane in status["lanes"]} == dict.fromkeys(
            ("verify", "draft", "audit", "orchestrator", "gateway"), "up"
        )
        assert status["totals"]["runs"] == 2 and status["active_requests"] == 0
        # The verify lane's totals come with its heartbeats: its loop's split into phases among them.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = json.loads(speclanes("status", "--json").stdout)
            verify = next(lane["totals"] for lane in status["lanes"] if lane["name"] == "verify")
            loop = verify["loop_seconds"]
            if loop.get("forward", 0) > 0:
                break
        assert loop["forward"] > 0 and set(loop) <= {p.value for p in LoopPhase}, loop
        assert "verify lane, ms a forward by phase since it started: forward " in speclanes("status").stdout
        bad = speclanes("stream", "--temperature", "-1", "hi")
        assert bad.returncode == 2 and "temperature" in bad.stderr
    finally:
        stopped = speclanes("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert speclanes("stop").returncode == 2  # nothing left to stop, said plainly


def test_a_second_start_on_the_run_directory_fails_at_once_and_leaves_the_first_alone(
    pipeline: Pipeline,
) -> None:
    before = {lane.name: lane.pid for lane in pipeline.status().lanes}
    assert pipeline.proc is not None
    for mode in (["--detach"], []):
        started = time.monotonic()
        command = [
            sys.executable,
            "-m",
            "pipeline.cli",
            "start",
            *mode,
            *(f"--set={s}" for s in pipeline.settings),
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 2, out
        assert out.returncode == 2 and f"already running in {pipeline.run_dir}" in out.stderr, out.stderr
        assert f"supervisor pid {pipeline.proc.pid}" in out.stderr
    assert {lane.name: lane.pid for lane in pipeline.status().lanes} == before
    assert pipeline.proc.poll() is None


# The lane, and a request that keeps it busy: drafts at every step for the draft lane.
STOPPED_LANES = [("verify", "none", 0), ("draft", "ngram", 4), ("audit", "none", 0)]


# The default restart.hang_seconds (5 s) scales the same figures (measured: noticed after 4.8 to
# 5.0 s, replaced after 6.3 to 7.7 s; README) and costs CI about 30 s a lane, so CI runs 2 s.
@pytest.mark.parametrize("hang", [2.0], ids=["hang2s"])
@pytest.mark.parametrize(("lane", "drafter", "k"), STOPPED_LANES, ids=[lane for lane, _, _ in STOPPED_LANES])
def test_a_stopped_lane_is_noticed_killed_and_replaced_and_the_stream_is_unchanged(
    tmp_path, lane: str, drafter: str, k: int, hang: float | None
) -> None:
    """SIGSTOP a lane mid-stream, stopped for good: within restart.hang_seconds `status` stops
    calling it up, the supervisor kills and restarts it, the request ends as an undisturbed run
    (re-primed for verify, plain steps for draft, events re-sent for audit) and its audit trail
    holds every step once."""
    settings_ = ["gateway.enabled=false", f"restart.hang_seconds={hang}"]
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    ref = _reference(STORY, params, "none", 0)
    with running_pipeline(tmp_path / "run", settings_) as pipe:
        stopped = pipe.lane(lane).pid
        assert stopped is not None
        emitted, marks = [0], {}

        def count(chunks) -> None:
            emitted[0] = sum(len(c.tokens) for c in chunks)

        def stopper() -> None:
            while emitted[0] < 15:
                time.sleep(0.01)
            os.kill(stopped, signal.SIGSTOP)
            marks["stopped"] = time.monotonic()
            pipe.wait_until(lambda r: next(x for x in r.lanes if x.name == lane).state != "up", 30)
            marks["noticed"] = time.monotonic()
            pipe.wait_lane_up(lane, stopped, 60)
            marks["replaced"] = time.monotonic()

        thread = threading.Thread(target=stopper, daemon=True)
        thread.start()
        with pipe.client(timeout=120) as client:
            request_id = client.submit(STORY, chat=True, params=params, drafter=drafter, k=k).request_id
            chunks, done = read_stream(client, request_id, on_chunk=count)
        thread.join(60)
        assert done.error is None and done.tokens == ref.tokens
        assert [t for c in chunks for t in c.tokens] == ref.tokens
        assert marks["noticed"] - marks["stopped"] < hang + 2.0, marks
        assert marks["replaced"] - marks["stopped"] < hang + 30.0, marks
        assert not alive(stopped)
        faults = [f for f in pipe.status().faults if f.lane == lane]
        assert {"timeout", "lane_down"} <= {f.kind for f in faults}
        pipe.wait_until(lambda r: r.audit_pending == 0, what="the audit outbox to empty")
        steps = [step for _, step, kind in pipe.audit_rows(request_id) if kind == "StepEvent"]
        assert steps == list(range(done.stats.steps + 1))  # every step once, the prefill as step 0
        print(
            f"SIGSTOP {lane}: noticed after {marks['noticed'] - marks['stopped']:.2f} s, "
            f"replaced after {marks['replaced'] - marks['stopped']:.2f} s (restart.hang_seconds={hang})"
        )


# A lane that dies at every start: restart.max_restarts small, back-off short, so it fails in seconds.
CRASH_LOOP = ["restart.max_restarts=3", "restart.initial_backoff=0.05", "restart.max_backoff=0.2"]
DEV_NULL = "FileExistsError: [Errno 17] File exists: '/dev/null'"  # what a lane says of a path under it


def test_a_crash_looping_audit_lane_is_failed_and_the_rest_serves_degraded(tmp_path) -> None:
    """audit.path under /dev/null: after restart.max_restarts restarts the audit lane is failed and
    never started again; `start --detach`, `status` and /health say why; requests are still served,
    their events held by the orchestrator; `stop` stops it all as usual."""
    import json
    import urllib.error
    import urllib.request

    pipe = Pipeline(tmp_path / "run", ["audit.path=/dev/null/x", *CRASH_LOOP])
    settings = [f"--set={s}" for s in pipe.settings]

    def speclanes(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pipeline.cli", *args, *settings]
        return subprocess.run(command, capture_output=True, text=True, timeout=180)

    started = speclanes("start", "--detach")
    assert started.returncode == 0, started.stderr
    try:
        assert f"speclanes: degraded: the audit lane failed: {DEV_NULL}" in started.stderr
        audit = pipe.lane("audit")
        assert (audit.state, audit.restarts, audit.reason) == ("failed", 3, DEV_NULL)
        params = SamplingParams(max_tokens=24)
        with pipe.client() as client:
            done = client.complete(CODE, chat=True, params=params, drafter="ngram")
        assert done.error is None and done.tokens == _reference(CODE, params, "none", 0).tokens
        time.sleep(2.5)  # the supervisor announces the failure again (every 2 s): nothing changes
        report = pipe.status()
        assert report.audit_pending > 0  # held in the orchestrator: no audit lane takes them
        failed = [f for f in report.faults if f.kind == "lane_failed"]
        assert [f.lane for f in failed] == ["audit"] and failed[0].message.endswith(DEV_NULL)
        log = (pipe.run_dir / "supervisor.log").read_text()
        assert log.count("audit started (pid") == 4  # the first start and 3 restarts, no more
        try:
            urllib.request.urlopen(f"{pipe.gateway_url}/health", timeout=10)
            raise AssertionError("/health answered 200 with a failed lane")
        except urllib.error.HTTPError as error:
            status, body = error.code, json.loads(error.read())
        assert status == 503 and body["failed"] == {"audit": DEV_NULL}
        assert body["reason"] == f"the audit lane failed: {DEV_NULL}"
        shown = json.loads(speclanes("status", "--json").stdout)
        assert shown["health"] == {
            "status": "unavailable",
            "reason": body["reason"],
            "failed": body["failed"],
        }
        assert {lane["name"]: lane["state"] for lane in shown["lanes"]} == {
            "verify": "up", "draft": "up", "audit": "failed", "orchestrator": "up", "gateway": "up"
        }  # fmt: skip
        assert f"health: the audit lane failed: {DEV_NULL}" in speclanes("status").stdout
    finally:
        stopped = speclanes("stop")
    assert stopped.returncode == 0, stopped.stderr


def test_a_crash_looping_verify_lane_stops_the_pipeline_with_the_reason(tmp_path) -> None:
    """The verify lane cannot listen (its address under /dev/null): after restart.max_restarts
    restarts it is failed, and nothing can be served without it, so the supervisor SIGTERMs the
    rest and exits 1 with the lane's own last error line."""
    from pipeline.service.run_dir import running_supervisor

    pipe = Pipeline(tmp_path / "run", ["listen.verify=ipc:///dev/null/verify.ipc", *CRASH_LOOP])
    command = [sys.executable, "-m", "pipeline.cli", "start", *(f"--set={s}" for s in pipe.settings)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=180)  # it exits on its own
    assert out.returncode == 1, out.stderr
    reason = f"the verify lane failed (it died 4 times): {DEV_NULL}"
    assert out.stderr.splitlines()[-1] == f"speclanes: error: {reason}"
    assert f"stopping the pipeline: {reason}" in out.stderr
    assert out.stderr.count("verify started (pid") == 4
    children = [int(pid) for pid in re.findall(r"started \(pid (\d+)", out.stderr)]
    assert _wait_gone(children) == []
    for lane in ("orchestrator", "draft", "audit"):  # stopped by the supervisor, not left to die
        assert "SIGTERM: exiting" in (pipe.run_dir / f"{lane}.log").read_text(), lane
    assert running_supervisor(pipe.run_dir) is None
