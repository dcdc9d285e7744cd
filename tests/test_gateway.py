"""The HTTP gateway as clients use it: the official `openai` package and curl against a real
pipeline (one shared by the module's tests), compared with in-process decoding; errors and
their statuses; a client that leaves mid-request. The first tests need no model: a gateway
alone, with no orchestrator behind it."""

from __future__ import annotations

import collections
import contextlib
import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import jsonschema
import msgspec
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import __version__, cli
from pipeline.api.core import NO_MAX_TOKENS
from pipeline.bench.common import PASSAGE
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.grammar.format import canonical_response_format
from pipeline.decoding.logprobs import token_string
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model.default import default_model_path
from pipeline.model.prompts import prompt_tokens
from pipeline.observability.trace_files import read_spans, trace_files
from pipeline.orchestration.tracing import FAULT_LANES, OUTCOMES
from pipeline.protocol.client import Client
from pipeline.protocol.config import load_config
from pipeline.protocol.messages import FaultKind
from pipeline.workers.loop_phases import LoopPhase

from .grammar_cases import CITY, ORDER, PERSON, REVIEW, TOOL_CALL, bounded
from .pipeline_harness import Pipeline, alive, free_port

CODE = "Write a Python function that reverses a string, then explain it."
PROMPTS = [
    CODE,
    "Tell me a long story about a lighthouse keeper and a storm.",
    "List five uses of a paperclip.",
    "What is the capital of France? Explain its history.",
]
CURL_SCRIPT = Path(__file__).with_name("gateway_curl.sh")


def fetch_json(
    url: str, body: bytes | None = None, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one request (POST when there is a body)."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_error(body: dict[str, Any], **expected: Any) -> None:
    """The OpenAI error shape, with the fields a test cares about."""
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    for key, value in expected.items():
        assert error[key] == value, (key, error)


# --- a gateway with nothing behind it (no model needed) -------------------------------


@pytest.fixture
def lone_gateway(tmp_path: Path) -> Iterator[str]:
    """A gateway process whose orchestrator address has nobody listening."""
    with gateway_process(tmp_path) as url:
        yield url


@contextlib.contextmanager
def gateway_process(tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    port = free_port()
    config = load_config(None, [f"run.dir={tmp_path}", f"gateway.port={port}"], environ={})
    path = tmp_path / "config.json"
    path.write_bytes(msgspec.json.encode(config))
    log = (tmp_path / "gateway.log").open("wb")
    command = [sys.executable, "-m", "lanes.gateway", str(path)]
    proc = subprocess.Popen(command, stdout=log, stderr=log, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "gateway.log"
                ).read_text()
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_with_an_api_key_only_health_answers_without_it(tmp_path: Path):
    with gateway_process(tmp_path, {"SPECLANES_API_KEY": "s3cret"}) as url:
        status, body = fetch_json(f"{url}/v1/models")
        assert status == 401
        assert_error(body, code="invalid_api_key", type="invalid_request_error")
        request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200 and json.loads(response.read())["object"] == "list"
        assert fetch_json(f"{url}/health")[0] == 503  # no orchestrator, but no key needed to ask


def test_without_an_orchestrator_requests_get_503_but_bad_ones_still_get_400_and_404(lone_gateway: str):
    status, body = fetch_json(f"{lone_gateway}/health")
    assert status == 503 and body["status"] == "unavailable" and "orchestrator" in body["reason"]
    started = time.monotonic()
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, body = fetch_json(f"{lone_gateway}/v1/chat/completions", json.dumps(request).encode())
    assert status == 503 and time.monotonic() - started < 10
    assert_error(body, type="server_error", code="pipeline_unavailable")
    # Checked before the pipeline is asked: these do not depend on it.
    status, body = fetch_json(f"{lone_gateway}/v1/completions", b'{"prompt": ')
    assert status == 400
    assert_error(body, type="invalid_request_error", code="invalid_json")
    status, body = fetch_json(
        f"{lone_gateway}/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode()
    )
    assert status == 404
    assert_error(body, param="model", code="model_not_found")
    status, body = fetch_json(f"{lone_gateway}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    status, body = fetch_json(f"{lone_gateway}/v2/nothing")
    assert status == 404
    assert_error(body, code="not_found")
    status, body = fetch_json(f"{lone_gateway}/metrics")  # the numbers live in the orchestrator
    assert status == 503
    assert_error(body, type="server_error", code="pipeline_unavailable")
    status, body = fetch_json(f"{lone_gateway}/version")
    assert status == 200 and body["version"] == __version__ and body["backend"] is None
    assert body["configured_backend"] == "auto"
    status, body = fetch_json(
        f"{lone_gateway}/tokenize", json.dumps({"content": "a", "prompt": "b"}).encode()
    )
    assert status == 400 and body["error"]["param"] == "prompt"


def _raw_post(url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Sends the request line and headers, then as much of `body` as the server takes before it
    answers; returns the answer's status, headers and JSON body, read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):  # the server may answer and close before taking it all
            sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    header_text, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *lines = header_text.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(payload)


def test_a_body_over_the_cap_is_a_413_before_it_is_read(lone_gateway: str):
    """Content-Length says 10 MB: refused from the headers alone (the body is never sent)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000\r\n\r\n"
    )
    status, headers, body = _raw_post(lone_gateway, head, b"")
    assert status == 413 and headers["connection"] == "close"
    assert_error(body, type="invalid_request_error", code="request_too_large")
    assert "10000000 bytes" in body["error"]["message"] and "1048576" in body["error"]["message"]


def test_a_chunked_body_is_cut_off_once_it_passes_the_cap(lone_gateway: str):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunks = (b"%x\r\n" % len(piece) + piece + b"\r\n") * 32 + b"0\r\n\r\n"  # 2 MiB
    status, _, body = _raw_post(lone_gateway, head, chunks)
    assert status == 413
    assert_error(body, code="request_too_large")
    assert "max_body_bytes" in body["error"]["message"]


def test_a_body_under_the_cap_goes_on_to_the_pipeline(lone_gateway: str):
    request = {"prompt": "x" * ((1 << 20) - 100), "max_tokens": 4}
    status, body = fetch_json(f"{lone_gateway}/v1/completions", json.dumps(request).encode())
    assert status == 503  # read whole, decoded, then the missing orchestrator answers
    assert_error(body, code="pipeline_unavailable")


def test_a_taken_port_is_reported_in_one_line(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = load_config(None, [f"run.dir={tmp_path}", f"gateway.port={port}"], environ={})
        path = tmp_path / "config.json"
        path.write_bytes(msgspec.json.encode(config))
        done = subprocess.run(
            [sys.executable, "-m", "lanes.gateway", str(path)], capture_output=True, text=True, timeout=60
        )
    assert done.returncode != 0
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in done.stderr and "Address already in use" in done.stderr


# --- a real pipeline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(gateway_pipeline: Pipeline) -> Pipeline:
    return gateway_pipeline  # the session's one (conftest.py), shared with test_tools_gateway.py


@pytest.fixture(scope="module")
def client(gateway_client: openai.OpenAI) -> openai.OpenAI:
    return gateway_client


@pytest.fixture(scope="module")
def model(pipeline: Pipeline) -> str:
    return pipeline.config.model_id()


_references: dict[tuple[str, bool, int], tuple[Result, int]] = {}


@pytest.fixture(scope="module")
def reference(served_model):
    """`speclanes generate` in-process (drafter none, greedy, the pipeline's backend): text, prompt length."""

    def run(prompt: str, chat: bool = True, max_tokens: int = 32) -> tuple[Result, int]:
        key = (prompt, chat, max_tokens)
        if key not in _references:
            tokens = prompt_tokens(served_model.tokenizer, prompt, chat=chat)
            params = SamplingParams(max_tokens=max_tokens)
            source = make_draft_source("none", served_model, None)
            _references[key] = (decode(served_model, tokens, params, source, k=0), len(tokens))
        return _references[key]

    return run


def stream_chat(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, headers: dict | None = None, **extra: Any
):
    """Text, closing chunk and usage chunk of one greedy streamed chat request."""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra, extra_headers=headers,
    )  # fmt: skip
    text, closing, usage_chunk = [], None, None
    for chunk in stream:
        if not chunk.choices:
            usage_chunk = chunk
            continue
        text.append(chunk.choices[0].delta.content or "")
        if chunk.choices[0].finish_reason is not None:
            closing = chunk
    return "".join(text), closing, usage_chunk


@pytest.mark.slow
def test_openai_streaming_chat_equals_generate(pipeline, client, model, reference):
    ref, n_prompt = reference(CODE, max_tokens=32)
    trace_id = os.urandom(16).hex()
    traceparent = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    text, closing, usage_chunk = stream_chat(
        client, model, CODE, 32, traceparent, speculation={"drafter": "ngram", "k": 4}
    )
    assert text == ref.text
    assert closing is not None and closing.choices[0].finish_reason == ref.finish_reason
    assert closing.usage is None and usage_chunk is not None and usage_chunk.usage is not None  # once
    usage = usage_chunk.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, len(ref.tokens))
    speculation = closing.model_extra["speculation"]
    assert speculation["drafter"] == "ngram" and speculation["steps"] >= 1
    assert closing.id == f"chatcmpl-{speculation['request_id']}"
    # The same request, as the pipeline recorded it.
    assert pipeline.summary(speculation["request_id"]).tokens == ref.tokens
    # The caller's traceparent header: the pipeline's spans for this request join its trace.
    deadline = time.monotonic() + 20
    while not any(
        s.trace_id == trace_id and s.service.endswith("orchestrator")
        for s in read_spans(trace_files(Path(pipeline.config.telemetry.dir)))[0]
    ):
        assert time.monotonic() < deadline, "no orchestrator span in the caller's trace"
        time.sleep(0.2)


@pytest.mark.slow
def test_one_http_request_is_one_trace_under_the_gateways_server_span(pipeline, client, model):
    """The gateway's HTTP server span joins the caller's trace and parents the pipeline's root span of
    every choice, which names the id the client got; a refused request leaves an error span too."""
    traced, refused_trace = os.urandom(16).hex(), os.urandom(16).hex()
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[2]}], n=2, max_tokens=4, temperature=0,
        extra_headers={"traceparent": f"00-{traced}-{os.urandom(8).hex()}-01"},
    )  # fmt: skip
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], n=0,
            extra_headers={"traceparent": f"00-{refused_trace}-{os.urandom(8).hex()}-01"},
        )  # fmt: skip
    route = "POST /v1/chat/completions"

    def spans_of(trace_id: str) -> list:
        return [
            s
            for s in read_spans(trace_files(Path(pipeline.config.telemetry.dir)))[0]
            if s.trace_id == trace_id
        ]

    deadline = time.monotonic() + 20
    while len([s for s in spans_of(traced) if s.name in (route, f"chat {model}")]) < 3 or not spans_of(
        refused_trace
    ):
        assert time.monotonic() < deadline, "the spans did not reach the trace files"
        time.sleep(0.2)
    (http,) = [s for s in spans_of(traced) if s.name == route and s.service.endswith("gateway")]
    assert http.attributes["http.response.status_code"] == 200 and http.status != "ERROR"
    assert http.attributes["gen_ai.response.id"] == response.id
    roots = [
        s for s in spans_of(traced) if s.parent_id == http.span_id and s.service.endswith("orchestrator")
    ]
    assert sorted(r.attributes["speclanes.request_id"] for r in roots) == [
        f"{response.id.removeprefix('chatcmpl-')}-{i}" for i in range(2)
    ]
    assert all(r.attributes["gen_ai.response.id"] == response.id for r in roots)
    (failed,) = spans_of(refused_trace)
    assert (failed.name, failed.status, failed.attributes["http.response.status_code"]) == (
        route,
        "ERROR",
        400,
    )
    assert failed.attributes["error.type"] == (bad.value.code or bad.value.type)


@pytest.mark.slow
def test_openai_non_streaming_chat_and_text_completions_equal_generate(client, model, reference):
    ref, n_prompt = reference(PROMPTS[2], max_tokens=16)
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[2]}],
        max_completion_tokens=16,
        temperature=0,
    )
    assert response.choices[0].message.content == ref.text
    assert response.choices[0].finish_reason == ref.finish_reason
    assert response.usage is not None and response.usage.prompt_tokens == n_prompt
    assert response.usage.completion_tokens == len(ref.tokens)
    assert response.model_extra["speculation"]["drafter"] == "auto"  # the pipeline's default

    raw = "def reverse(text):\n    "
    ref, n_prompt = reference(raw, chat=False, max_tokens=16)
    whole = client.completions.create(model=model, prompt=raw, max_tokens=16, temperature=0)
    assert whole.choices[0].text == ref.text and whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, len(ref.tokens))
    pieces = client.completions.create(
        model=model,
        prompt=raw,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"speculation": {"k": 0}},
    )
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].model_extra["speculation"]["steps"] == len(ref.tokens) - 1  # k = 0: one token a step


@pytest.mark.slow
def test_a_request_naming_no_max_tokens_runs_to_its_end_of_sequence(client, model, reference):
    """As vLLM: no max_tokens is no cap (gateway.default_max_tokens is 0), where it once was 128."""
    ref, _ = reference(CODE, max_tokens=NO_MAX_TOKENS)
    assert ref.finish_reason == "stop" and len(ref.tokens) > 128  # the model goes on past 128 tokens
    messages = [{"role": "user", "content": CODE}]
    response = client.chat.completions.create(model=model, messages=messages, temperature=0)
    assert response.choices[0].message.content == ref.text and response.choices[0].finish_reason == "stop"
    assert response.usage is not None and response.usage.completion_tokens == len(ref.tokens)


@pytest.mark.slow
def test_curl_streams_server_sent_events(pipeline, model, reference, tmp_path):
    ref, _ = reference(PROMPTS[3], max_tokens=16)
    body = tmp_path / "body.json"
    request = {
        "model": model, "messages": [{"role": "user", "content": PROMPTS[3]}],
        "max_tokens": 16, "temperature": 0, "stream": True, "speculation": {"drafter": "ngram"},
    }  # fmt: skip
    body.write_text(json.dumps(request))
    done = subprocess.run(
        ["bash", str(CURL_SCRIPT), pipeline.gateway_url, str(body)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "health 200" and lines[-2:] == ["malformed 400", "unknown-model 404"]
    events = [line.removeprefix("data: ") for line in lines[1:-2] if line]
    assert all(line.startswith("data: ") for line in lines[1:-2] if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref.text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == ref.finish_reason
    assert not any("usage" in c for c in chunks)  # no include_usage: no usage, as OpenAI's streams


@pytest.mark.slow
def test_eight_concurrent_streaming_clients_each_get_their_own_correct_output(pipeline, model, reference):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            client = openai.OpenAI(
                base_url=f"{pipeline.gateway_url}/v1", api_key="-", max_retries=0, timeout=300
            )
            results[i] = stream_chat(client, model, PROMPTS[i % 4], 16, speculation={"drafter": "ngram"})[0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors and len(results) == 8
    for i, text in results.items():
        assert text == reference(PROMPTS[i % 4], max_tokens=16)[0].text, i
    pipeline.wait_until(lambda r: r.active_requests == 0, what="every request finished")


@pytest.mark.slow
def test_models_health_and_status(pipeline, client, model):
    assert [m.id for m in client.models.list()] == [model] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.models.retrieve(model).owned_by == "speclanes"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert fetch_json(f"{pipeline.gateway_url}/health") == (200, {"status": "ok", "model": model})
    gateway = pipeline.lane("gateway")
    assert gateway.state == "up" and gateway.pid is not None and alive(gateway.pid)


@pytest.mark.slow
def test_error_statuses_through_the_openai_client(pipeline, client, model):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    for n in (0, 17):  # gateway.max_choices is 16
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=model, messages=messages, n=n)
        assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", extra_body={"speculation": {"drafter": "oracle"}})
    assert bad.value.param == "speculation.drafter"
    with pytest.raises(openai.BadRequestError) as bad:  # refused by the orchestrator, which tokenizes
        client.completions.create(model=model, prompt="x" * 40_000, max_tokens=4)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as bad:  # streaming: the error comes before the stream
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x" * 40_000}], stream=True
        )
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "messages"
    assert pipeline.status().active_requests == 0


@pytest.mark.slow
def test_sampling_controls_and_token_prompts_through_the_openai_client_equal_generate(
    client, model, served_model
):
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty and min_p (extra_body), a prompt
    given as token ids: the pipeline, speculating, serves what in-process plain decoding gives."""
    ids = prompt_tokens(served_model.tokenizer, "def reverse(text):\n    ", chat=False)
    none = make_draft_source("none", served_model, None)
    unbiased = SamplingParams(
        max_tokens=16, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.2
    )
    first = decode(served_model, ids, unbiased, none, k=0).tokens[0]  # banned: the output must change
    greedy = msgspec.structs.replace(unbiased, logit_bias={first: -100, 13: 2.0})
    ref = decode(served_model, ids, greedy, none, k=0)
    response = client.completions.create(
        model=model, prompt=ids, max_tokens=16, temperature=0, presence_penalty=0.6, frequency_penalty=0.4,
        logit_bias={str(first): -100, "13": 2.0},
        extra_body={"repetition_penalty": 1.2, "speculation": {"drafter": "ngram", "k": 4}},
    )  # fmt: skip
    assert response.choices[0].text == ref.text and ref.tokens[0] != first
    assert response.usage is not None and response.usage.prompt_tokens == len(ids)

    chat = prompt_tokens(served_model.tokenizer, PROMPTS[2], chat=True)
    seeded = SamplingParams(
        temperature=0.8, top_p=0.95, seed=7, max_tokens=24, min_p=0.05, presence_penalty=-0.5,
        frequency_penalty=1.0, repetition_penalty=0.9,
    )  # fmt: skip
    want = decode(served_model, chat, seeded, none, k=0)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=24, temperature=0.8,
        top_p=0.95, seed=7, presence_penalty=-0.5, frequency_penalty=1.0, stream=True,
        extra_body={"min_p": 0.05, "repetition_penalty": 0.9, "speculation": {"drafter": "auto"}},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", extra_body={"min_p": 1.5})
    assert bad.value.param == "min_p"
    with pytest.raises(openai.BadRequestError) as bad:  # the orchestrator knows the vocabulary
        client.completions.create(model=model, prompt="hi", logit_bias={"10000000": 1})
    assert bad.value.param == "logit_bias" and "vocabulary" in bad.value.message


def assert_logprobs_match(got: list[Any], want: list[Any]) -> None:
    """OpenAI chat entries (the client's models) against in-process `TokenLogprobs`: the issue's 1e-5."""
    assert len(got) == len(want)
    for entry, expected in zip(got, want, strict=True):
        assert entry.token == token_string(expected.piece) and bytes(entry.bytes) == expected.piece
        assert abs(entry.logprob - expected.logprob) <= 1e-5
        tops = [(t.token, t.logprob) for t in entry.top_logprobs]
        assert [t for t, _ in tops] == [token_string(t.piece) for t in expected.top]
        assert all(abs(lp - t.logprob) <= 1e-5 for (_, lp), t in zip(tops, expected.top, strict=True))


@pytest.mark.slow
def test_logprobs_through_the_openai_client_equal_in_process_decoding(client, model, served_model):
    """Chat streamed and whole, and completions, with 5 alternatives a token while speculating: an entry
    for every completion token, the entries spell the text, and the numbers are those the in-process
    target computes at the same positions (1e-5, the issue's bound; the runtime makes them equal)."""
    none = make_draft_source("none", served_model, None)
    eos = served_model.tokenizer.token_bytes(served_model.tokenizer.eos_id).decode()
    messages = [{"role": "user", "content": PROMPTS[2]}]
    ids = prompt_tokens(served_model.tokenizer, PROMPTS[2], chat=True)
    want = decode(served_model, ids, SamplingParams(max_tokens=16, logprobs=5), none, k=0)
    asked = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True}
    stream = client.chat.completions.create(
        **asked, top_logprobs=5, stream=True, stream_options={"include_usage": True},
        extra_body={"speculation": {"drafter": "ngram", "k": 4}},
    )  # fmt: skip
    text, content, usage = [], [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        elif chunk.choices[0].logprobs is not None:  # each chunk: its delta's tokens
            text.append(chunk.choices[0].delta.content or "")
            content.extend(chunk.choices[0].logprobs.content or [])
    whole = client.chat.completions.create(**asked, top_logprobs=5)
    assert "".join(text) == want.text == whole.choices[0].message.content
    assert usage is not None and len(content) == usage.completion_tokens == len(want.tokens)
    spelled = want.text + (eos if want.tokens[-1] == served_model.tokenizer.eos_id else "")
    assert "".join(t.token for t in content) == spelled
    for got in (content, whole.choices[0].logprobs.content):
        assert_logprobs_match(got, want.logprobs)

    raw = "def reverse(text):\n    "
    ids = prompt_tokens(served_model.tokenizer, raw, chat=False)
    want = decode(served_model, ids, SamplingParams(max_tokens=16, logprobs=5), none, k=0)
    text_completion = client.completions.create(
        model=model, prompt=raw, max_tokens=16, temperature=0, logprobs=5
    )
    logprobs = text_completion.choices[0].logprobs
    assert logprobs.tokens == [token_string(e.piece) for e in want.logprobs]
    assert len(logprobs.tokens) == text_completion.usage.completion_tokens
    assert np.allclose(logprobs.token_logprobs, [e.logprob for e in want.logprobs], rtol=0, atol=1e-5)
    for alternatives, expected in zip(logprobs.top_logprobs, want.logprobs, strict=True):
        chosen = {token_string(t.piece): t.logprob for t in expected.top} | {
            token_string(expected.piece): expected.logprob
        }
        assert alternatives.keys() == chosen.keys()
        assert all(abs(alternatives[key] - value) <= 1e-5 for key, value in chosen.items())
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    for bad, param in (
        (lambda: client.chat.completions.create(**asked, top_logprobs=21), "top_logprobs"),
        (
            lambda: client.chat.completions.create(**(asked | {"logprobs": False}), top_logprobs=3),
            "top_logprobs",
        ),
        (lambda: client.completions.create(model=model, prompt=raw, logprobs=21), "logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            bad()
        assert caught.value.param == param


STRUCTURED = [  # (prompt, response_format, the schema its output validates against)
    (
        'Give me a JSON object with the keys "city" and "country" for Paris.',
        {"type": "json_object"},
        {"type": "object"},
    ),
    (
        "What is the weather in Paris? Answer with a tool call.",
        {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": TOOL_CALL, "strict": True}},
        TOOL_CALL,
    ),
]


def structured_chat(client: openai.OpenAI, model: str, prompt: str, fmt: dict, stream: bool, **fields: Any):
    """The text and finish reason of one chat completion with a response_format."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        response = client.chat.completions.create(
            model=model, messages=messages, response_format=fmt, max_tokens=64, **fields
        )
        return response.choices[0].message.content, response.choices[0].finish_reason
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, response_format=fmt, max_tokens=64, stream=True, **fields
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.slow
def test_structured_output_through_the_openai_client(pipeline, client, model, served_model):
    """json_object and json_schema, streamed and not, greedy and seeded: every drafter serves exactly
    in-process plain constrained decoding's text, which parses and validates; the grammar extension on
    a text completion. Formats that are
    malformed, that the grammar library refuses, or that come with ignore_eos are 400s naming
    response_format (the first from the gateway, the second from the orchestrator, which compiles it)."""
    none = make_draft_source("none", served_model, None)
    seeded = {"temperature": 0.7, "seed": 3}
    for prompt, fmt, schema in STRUCTURED:
        tokens = prompt_tokens(served_model.tokenizer, prompt, chat=True)
        greedy = SamplingParams(max_tokens=64, response_format=canonical_response_format(fmt))
        want = decode(served_model, tokens, greedy, none, k=0)
        assert want.finish_reason == "stop"
        jsonschema.validate(json.loads(want.text), schema)
        for drafter, stream in (("none", False), ("auto", True), ("ngram", False), ("suffix", True)):
            extra = {"speculation": {"drafter": drafter}}
            got = structured_chat(client, model, prompt, fmt, stream, temperature=0, extra_body=extra)
            assert got == (want.text, "stop"), drafter
        sampled = decode(served_model, tokens, msgspec.structs.replace(greedy, **seeded), none, k=0)
        got = structured_chat(client, model, prompt, fmt, True, **seeded)  # the default drafter, auto
        assert got == (sampled.text, sampled.finish_reason)
        if sampled.finish_reason == "stop":
            jsonschema.validate(json.loads(sampled.text), schema)
    # The grammar extension (GBNF here), on a text completion as vLLM takes response_format there.
    grammar = {"type": "grammar", "grammar": 'root ::= ("yes" | "no") "."'}
    question = "Q: Is Paris the capital of France? A:"
    params = SamplingParams(max_tokens=8, response_format=canonical_response_format(grammar))
    want = decode(
        served_model, prompt_tokens(served_model.tokenizer, question, chat=False), params, none, k=0
    )
    answer = client.completions.create(
        model=model, prompt=question, max_tokens=8, temperature=0, extra_body={"response_format": grammar}
    )
    assert (
        answer.choices[0].text == want.text in ("yes.", "no.") and answer.choices[0].finish_reason == "stop"
    )
    refused = {
        "gateway": {"type": "json_schema", "json_schema": {"name": "x"}},
        "orchestrator": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    }
    for where, fmt in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            structured_chat(client, model, "hi", fmt, stream=where == "orchestrator")
        assert bad.value.param == "response_format", where
    with pytest.raises(openai.BadRequestError) as bad:  # past the grammar's end only EOS may come
        extra = {"response_format": {"type": "json_object"}, "ignore_eos": True}
        client.completions.create(model=model, prompt="{", extra_body=extra)
    assert bad.value.param == "response_format"


VALIDATED = {  # five schemas, ten seeds each: the "50 generated outputs across several schemas"
    "person": ("Describe Ada Lovelace as JSON.", PERSON),
    "order": ("Write an example online order as JSON.", ORDER),
    "tool_call": ("What is the weather in Paris? Answer with a tool call.", TOOL_CALL),
    "city": ("Describe the city of Lyon as JSON.", CITY),
    "review": ("Review a pair of running shoes as JSON.", REVIEW),
}


@pytest.mark.slow
def test_sampled_json_schema_outputs_validate(served_model):
    """Sampled at temperature 0.7 with the default drafter (`auto`, token trees), in-process on the
    default model (the lanes serve these same tokens: `test_structured_output_through_the_openai_client`):
    every output ends by itself and validates against its schema. The schemas are grammar_cases'
    with bounds on the strings, arrays and integers they leave unbounded (`bounded`: a sampling 135M
    model can write one string until max_tokens otherwise). Ten outputs in CI, to fit its time;
    SPECLANES_VALIDATED_OUTPUTS=50 makes the issue's fifty (ten seeds a schema)."""
    tokenizer, count = served_model.tokenizer, int(os.environ.get("SPECLANES_VALIDATED_OUTPUTS", "10"))
    outputs = []
    for name, (prompt, schema) in VALIDATED.items():
        bounded_schema = {"name": name, "schema": bounded(schema), "strict": True}
        fmt = {"type": "json_schema", "json_schema": bounded_schema}
        ids = prompt_tokens(tokenizer, prompt, chat=True)
        for seed in range(count // len(VALIDATED)):
            params = SamplingParams(
                max_tokens=256, temperature=0.7, seed=seed, response_format=canonical_response_format(fmt)
            )
            source = make_draft_source("auto", served_model, None)
            outputs.append((name, decode(served_model, ids, params, source)))
    assert len(outputs) == count
    for name, result in outputs:
        assert result.finish_reason == "stop", (name, result.text)
        document = json.loads(result.text)
        jsonschema.validate(document, bounded(VALIDATED[name][1]))
        jsonschema.validate(document, VALIDATED[name][1])  # the bounded schema only narrows the original
    assert len({result.text for _, result in outputs}) > 0.8 * count  # sampled: seeds give their own


def _idle(report) -> bool:
    lanes = {lane.name: lane for lane in report.lanes}
    return report.active_requests == 0 and lanes["verify"].active_requests == 0


def _freed(pipeline: Pipeline, what: str) -> None:
    """The pipeline forgets the request well before the orchestrator's idle timeout (60 s here)."""
    try:
        pipeline.wait_until(_idle, timeout=20, what=what)
    except AssertionError as exc:  # say what the gateway saw
        log = (pipeline.run_dir / "gateway.log").read_text().splitlines()[-15:]
        raise AssertionError("\n".join([str(exc), "gateway.log:", *log])) from None


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_cancels_its_request(pipeline, client, model):
    pipeline.wait_until(_idle, what="no request left from earlier tests")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=2000, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "speculation": {"drafter": "none"}},
    )  # fmt: skip
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    request_id = chunk.id.removeprefix("chatcmpl-")
    assert pipeline.status().active_requests == 1
    stream.close()  # the connection goes; nothing else is said
    _freed(pipeline, "the streamed request to be cancelled")
    done = pipeline.summary(request_id)
    assert done.finish_reason == "cancelled" and len(done.tokens) < 2000


@pytest.mark.slow
def test_a_client_that_disconnects_while_waiting_for_a_whole_completion_cancels_it(pipeline, model):
    pipeline.wait_until(_idle, what="no request left from earlier tests")
    request = {"model": model, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    host, port = pipeline.config.gateway.host, pipeline.config.gateway.port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(request), {"Content-Type": "application/json"})
    pipeline.wait_until(lambda r: r.active_requests == 1, what="the request to start")
    connection.close()
    _freed(pipeline, "the non-streamed request to be cancelled")


def cli_json(pipeline: Pipeline, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """`speclanes ARGV --json` against the module's pipeline, in this process."""
    settings = [f"--set={item}" for item in pipeline.settings]
    assert cli.main([*argv, "--json", *settings]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_tokenize_detokenize_and_version(pipeline, model, reference):
    url = pipeline.gateway_url
    _, n_prompt = reference(CODE, max_tokens=32)  # the chat completion's usage.prompt_tokens
    status, out = fetch_json(
        f"{url}/tokenize", json.dumps({"messages": [{"role": "user", "content": CODE}]}).encode()
    )
    assert status == 200 and out["count"] == len(out["tokens"]) == n_prompt and out["max_model_len"] == 8192
    status, text = fetch_json(f"{url}/tokenize", json.dumps({"content": CODE, "with_pieces": True}).encode())
    ids = [t["id"] for t in text["tokens"]]
    assert status == 200 and "".join(t["piece"] for t in text["tokens"]) == CODE
    for field in ("content", "prompt"):  # llama-server's and vLLM's spellings, both answered
        assert (
            fetch_json(f"{url}/tokenize", json.dumps({field: CODE, "model": model}).encode())[1]["tokens"]
            == ids
        )
    status, back = fetch_json(f"{url}/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and back == {"content": CODE, "prompt": CODE}
    status, body = fetch_json(f"{url}/detokenize", json.dumps({"tokens": [5, 10**6]}).encode())
    assert status == 400 and "tokens[1] = 1000000" in body["error"]["message"]
    assert_error(body, param="tokens", type="invalid_request_error")
    status, body = fetch_json(f"{url}/tokenize", json.dumps({"content": "a", "prompt": "a"}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    assert fetch_json(f"{url}/tokenize", json.dumps({"content": "a", "model": "gpt-4o"}).encode())[0] == 404
    status, version = fetch_json(f"{url}/version")
    verify = pipeline.lane("verify").runtime
    assert status == 200 and version["version"] == __version__ and version["model"] == model
    assert version["model_path"] == str(default_model_path()) and version["backend"] == verify["backend"]


@pytest.mark.slow
def test_response_ids_name_the_request_in_audit_and_trace(pipeline, client, model, capsys):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=8, temperature=0
    )
    assert response.id.startswith("chatcmpl-")
    pipeline.summary(response.id.removeprefix("chatcmpl-"))  # recorded
    shown = cli_json(pipeline, capsys, "audit", "show", response.id)
    assert shown["request_id"] == response.id.removeprefix("chatcmpl-")
    settings = shown["opened"]["settings"]
    assert settings["model"] == str(default_model_path()) and settings["model_name"] == model
    prefix = response.id[: len("chatcmpl-") + 10]
    deadline = time.monotonic() + 20
    named: list[dict] = []
    while len(named) < 2:  # each process's spans reach its file within a moment, not at the same one
        assert time.monotonic() < deadline, f"the response id's spans were not all written: {named}"
        time.sleep(0.2)
        with contextlib.suppress(AssertionError):  # no trace for the id yet
            spans = cli_json(pipeline, capsys, "trace", prefix)
            # The id the client received, on the gateway's HTTP span and the pipeline's root span
            # (GenAI conventions).
            named = [s for s in spans if s["attributes"].get("gen_ai.response.id") == response.id]
    roots = [s for s in named if s["attributes"].get("speclanes.request_id") == shown["request_id"]]
    assert len(named) == 2 and len(roots) == 1


@pytest.mark.slow
def test_ctrl_c_on_stream_cancels_its_request_at_once(pipeline):
    pipeline.wait_until(_idle, what="no request left from earlier tests")
    settings = [f"--set={item}" for item in pipeline.settings]
    command = [sys.executable, "-m", "pipeline.cli", "stream", PROMPTS[1], "--chat", "--max-tokens=2000"]
    command += ["--ignore-eos", "--drafter=none", *settings]
    # As a terminal's shell starts a foreground job: SIGINT at its default, so Python turns it into
    # KeyboardInterrupt (a job started in the background, `pytest &`, would pass it on ignored).
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    try:
        assert proc.stdout is not None and proc.stdout.read(8), "no text streamed"
        assert pipeline.status().active_requests == 1
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    request_id = err.decode().strip().rsplit(" ", 1)[-1]
    assert err.decode().startswith(f"speclanes: cancelled request {request_id}")
    pipeline.wait_until(_idle, timeout=5, what="the request cancelled (timeouts.client_idle is 60 s here)")
    assert time.monotonic() - interrupted < 5
    done = pipeline.summary(request_id)
    assert done.finish_reason == "cancelled" and len(done.tokens) < 2000


def reused(pipeline: Pipeline) -> int:
    return pipeline.lane("verify").totals.prompt_tokens_reused


@pytest.mark.slow
def test_n_greedy_choices_each_equal_one_request_and_share_one_prefill(
    pipeline, client, model, reference, capsys
):
    """n = 3, greedy: three times the n = 1 text, usage counting the prompt once, each choice a
    request of its own (`audit show` takes its id), and the verify lane copied the prompt's K/V
    for two of them (all but the last token each) instead of computing it."""
    ref, n_prompt = reference(PROMPTS[2], max_tokens=16)
    pipeline.wait_until(_idle, what="no request left from earlier tests")
    before = reused(pipeline)
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[2]}], n=3, max_tokens=16, temperature=0,
        extra_body={"speculation": {"drafter": "ngram", "k": 4}},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(
        (c.message.content, c.finish_reason) == (ref.text, ref.finish_reason) for c in response.choices
    )
    assert response.usage is not None and response.usage.prompt_tokens == n_prompt
    assert response.usage.completion_tokens == 3 * len(ref.tokens)
    base = response.id.removeprefix("chatcmpl-")
    ids = [c.model_extra["speculation"]["request_id"] for c in response.choices]
    assert ids == [f"{base}-{i}" for i in range(3)]
    pipeline.wait_until(lambda r: reused(pipeline) > before, what="the verify lane's next heartbeat")
    assert reused(pipeline) - before == 2 * (n_prompt - 1)
    with urllib.request.urlopen(f"{pipeline.gateway_url}/metrics", timeout=30) as scraped:
        families = text_string_to_metric_families(scraped.read().decode())
        counted = [
            s.value for f in families for s in f.samples if s.name == "speclanes_prompt_reused_tokens_total"
        ]
    assert counted == [reused(pipeline)]
    # the audit trail lags the responses by up to audit.batch_seconds
    pipeline.wait_until(lambda r: r.audit_pending == 0, what="the audit outbox to empty")
    assert cli_json(pipeline, capsys, "audit", "show", f"{response.id}-2")["request_id"] == ids[2]


@pytest.mark.slow
def test_n_seeded_streamed_choices_are_the_requests_with_seed_plus_their_index(client, model, served_model):
    """Chunks of the three choices interleave, each tagged with its index; choice i is what plain
    decoding gives with seed 40 + i; the include_usage chunk sums the completions."""
    raw = "Once upon a time, in a town by the sea,"
    ids = prompt_tokens(served_model.tokenizer, raw, chat=False)
    none = make_draft_source("none", served_model, None)
    wanted = [
        decode(
            served_model,
            ids,
            SamplingParams(temperature=0.8, top_p=0.95, seed=40 + i, max_tokens=20),
            none,
            k=0,
        )
        for i in range(3)
    ]
    stream = client.completions.create(
        model=model, prompt=raw, n=3, max_tokens=20, temperature=0.8, top_p=0.95, seed=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculation": {"drafter": "auto"}},
    )  # fmt: skip
    texts, reasons, usage = collections.defaultdict(str), {}, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
            assert chunk.model_extra["speculation"]["seed"] == 40 + choice.index
    assert [texts[i] for i in range(3)] == [w.text for w in wanted]
    assert reasons == {i: w.finish_reason for i, w in enumerate(wanted)}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        len(ids), sum(len(w.tokens) for w in wanted),
    )  # fmt: skip


@pytest.mark.slow
def test_a_client_that_leaves_an_n_stream_cancels_every_choice(pipeline, client, model):
    pipeline.wait_until(_idle, what="no request left from earlier tests")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], n=3, max_tokens=2000,
        temperature=0.7, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [chunk for chunk, _ in zip(stream, range(8), strict=False)]
    base = chunks[0].id.removeprefix("chatcmpl-")
    assert pipeline.status().active_requests == 3
    stream.close()
    _freed(pipeline, "every choice cancelled")
    for i in range(3):
        done = pipeline.summary(f"{base}-{i}")
        assert done.finish_reason == "cancelled" and len(done.tokens) < 2000


@pytest.mark.slow
def test_metrics_agree_with_status_and_the_audit_trail(pipeline, client, model, served_model, capsys):
    """Scraped after every request of this module has finished and been recorded (cancelled ones too).
    Its own requests make every figure checked here non-zero, whichever tests ran before it: a copy
    of a passage, which n-gram drafts from the prompt are accepted on, as a chat and as a completion."""
    copy = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"
    for drafter in ("ngram", "none"):
        asked = {"model": model, "temperature": 0, "extra_body": {"speculation": {"drafter": drafter}}}
        client.chat.completions.create(messages=[{"role": "user", "content": copy}], max_tokens=32, **asked)
        client.completions.create(prompt=CODE, max_tokens=8, **asked)
    pipeline.wait_until(
        lambda r: _idle(r) and r.queued_requests == 0 and r.audit_pending == 0, what="everything recorded"
    )
    with urllib.request.urlopen(f"{pipeline.gateway_url}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")  # prometheus_client's
        found: dict[str, list] = {}
        for family in text_string_to_metric_families(response.read().decode()):
            for sample in family.samples:
                found.setdefault(sample.name, []).append(sample)
    status, audit = cli_json(pipeline, capsys, "status"), cli_json(pipeline, capsys, "audit", "stats")

    def total(name: str, **labels: str) -> float:
        return sum(
            s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
        )

    drafted, accepted = total("speclanes_tokens_drafted_total"), total("speclanes_tokens_accepted_total")
    assert accepted > 0
    # The verify lane's loop by phase, scraped before `status` was read: never ahead of it.
    phases = {s.labels["speclanes_phase"]: s.value for s in found["speclanes_verify_loop_time_seconds_total"]}
    loop = next(lane["totals"] for lane in status["lanes"] if lane["name"] == "verify")["loop_seconds"]
    assert set(phases) <= {p.value for p in LoopPhase} and phases["forward"] > 0
    assert all(phases[p] <= loop[p] for p in phases)
    genai = {"gen_ai_provider_name": "speclanes"}  # the GenAI conventions' labels, with the operation
    for name in (
        "gen_ai_server_request_duration_seconds_count",
        "gen_ai_server_time_to_first_token_seconds_count",
    ):
        assert all(s.labels["gen_ai_operation_name"] in ("chat", "text_completion") for s in found[name])
        assert total(name) == total(name, **genai) > 0
    assert (drafted, accepted) == (status["totals"]["drafted"], status["totals"]["accepted"])
    assert (drafted, accepted) == (audit["drafted"], audit["accepted"])
    finished = total("gen_ai_server_request_duration_seconds_count")
    assert finished == status["totals"]["runs"] == audit["finished_requests"] >= 2
    cancelled = total(
        "gen_ai_server_request_duration_seconds_count", gen_ai_response_finish_reasons="cancelled"
    )
    assert cancelled == audit["finish_reasons"].get("cancelled", 0)
    assert total("speclanes_tokens_usage_total", gen_ai_token_type="output") == audit["output_tokens"]
    kinds = collections.Counter(f["kind"] for f in status["faults"])
    faults = collections.Counter()
    for s in found["speclanes_faults_total"]:  # every kind on every lane, at 0 until it happens
        faults[s.labels["speclanes_fault_kind"]] += s.value
    assert faults == kinds and len(faults) == len(get_args(FaultKind))
    assert len(found["speclanes_faults_total"]) == len(faults) * len(FAULT_LANES)
    # How requests ended: whatever is not an error is a run in `status`, and finished in the audit trail.
    ended = {outcome: total("speclanes_requests_total", speclanes_outcome=outcome) for outcome in OUTCOMES}
    assert ended["finished"] + ended["aborted"] == status["totals"]["runs"] == audit["finished_requests"]
    reasons = audit["finish_reasons"]
    assert ended["aborted"] == sum(reasons.get(reason, 0) for reason in OUTCOMES["aborted"])
    errors = total("gen_ai_server_request_duration_seconds_count", gen_ai_response_finish_reasons="error")
    assert ended["error"] == errors
    per_token = total("gen_ai_server_time_per_output_token_seconds_count")  # requests of over one token
    assert 0 < per_token == total("gen_ai_server_time_per_output_token_seconds_count", **genai) <= finished
    prefilled = total("speclanes_request_prefill_time_seconds_count")
    assert total("speclanes_request_queue_time_seconds_count") >= prefilled > 0
    assert total("speclanes_kv_cache_tokens") == total("speclanes_kv_cache_usage") == 0  # nothing decoding
    capacity = served_model.cfg.context_length * pipeline.config.admission.max_running
    assert total("speclanes_kv_cache_capacity") == capacity
    restarts = {s.labels["speclanes_lane"]: s.value for s in found["speclanes_lane_restarts_total"]}
    assert restarts == {lane["name"]: lane["restarts"] for lane in status["lanes"]}
    up = {s.labels["speclanes_lane"]: s.value for s in found["speclanes_lane_up"]}
    assert up == {lane["name"]: 1.0 for lane in status["lanes"]}  # gateway included
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"):
        measured = {(s.labels["speclanes_lane"], s.labels["process_pid"]): s.value for s in found[name]}
        assert measured.keys() == {(lane["name"], str(lane["pid"])) for lane in status["lanes"]}, name
        assert all(value > 0 for value in measured.values()), name  # each process's own, by heartbeat
    assert total("speclanes_requests_active") == total("speclanes_requests_queued") == 0
    assert total("speclanes_step_duration_seconds_count", speclanes_lane="verify") > 0
    assert 0 < total("gen_ai_server_time_to_first_token_seconds_count") <= finished  # some left before one


@pytest.mark.slow
def test_503_while_the_verify_lane_is_not_up(tmp_path: Path):
    """A pipeline without a verify lane: the gateway says why instead of waiting forever."""
    p = Pipeline(tmp_path / "run", ['run.components=["orchestrator", "gateway"]'])
    p.run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "pipeline.cli", "start", *(f"--set={s}" for s in p.settings)]
    log = (p.run_dir / "supervisor.log").open("ab")
    p.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        with Client(p.config.addresses.client, timeout=90) as pipe:  # waits for the orchestrator
            deadline = time.monotonic() + 90
            while {x.name for x in pipe.status().lanes if x.state == "up"} != {"gateway", "orchestrator"}:
                assert time.monotonic() < deadline, "the gateway and the orchestrator did not come up"
                time.sleep(0.1)
        status, body = fetch_json(f"{p.gateway_url}/health")
        assert status == 503 and "not up: verify" in body["reason"]
        status, body = fetch_json(f"{p.gateway_url}/v1/completions", json.dumps({"prompt": "hi"}).encode())
        assert status == 503
        assert_error(body, type="server_error", code="pipeline_unavailable")
        assert "verify" in body["error"]["message"]
    finally:
        p.stop()
    assert p.proc.returncode == 0
    with pytest.raises(ConnectionError):  # the gateway went with its supervisor
        socket.create_connection((p.config.gateway.host, p.config.gateway.port), timeout=2).close()
