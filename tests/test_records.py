"""Naming a request to `speclanes audit` and `speclanes trace`: its id, the id the HTTP API answered
with (`chatcmpl-...`, `cmpl-...`), or a unique prefix; a prefix that fits several is an error that
lists them. In-process: an audit store and telemetry spans written here. A real pipeline's response
ids are checked against both commands in tests/test_gateway.py."""

from __future__ import annotations

import json

import pytest

from pipeline import cli
from pipeline.audit.store import AuditStore
from pipeline.observability.request_ids import RESPONSE_PREFIXES, AmbiguousId, request_key, resolve
from pipeline.observability.trace_files import SpanRecord, find_trace
from pipeline.protocol.messages import RequestOpened, SpeculativeEvent

IDS = ["3f2a9c0d" + "1" * 24, "3f2a9c0d" + "2" * 24, "77aa" + "0" * 28]


def test_request_keys_drop_the_response_prefixes():
    assert request_key("chatcmpl-3f2a") == "3f2a" and request_key("cmpl-3f2a") == "3f2a"
    assert request_key("resp_3f2a") == "3f2a"
    assert request_key(" 3f2a\n") == "3f2a" and request_key("chat-3f2a") == "chat-3f2a"
    assert set(RESPONSE_PREFIXES.values()) == {"chatcmpl-", "cmpl-", "resp_"}


def test_resolve_takes_an_id_a_response_id_or_a_unique_prefix():
    assert resolve(IDS[0], IDS) == IDS[0]
    assert resolve(f"chatcmpl-{IDS[2]}", IDS) == IDS[2] == resolve("cmpl-77", IDS) == resolve("77a", IDS)
    with pytest.raises(AmbiguousId) as caught:
        resolve("chatcmpl-3f2a", IDS)
    message = str(caught.value)
    assert "fits 2 requests" in message and IDS[0] in message and IDS[1] in message and IDS[2] not in message
    with pytest.raises(LookupError, match="no request"):
        resolve("ffff", IDS)
    with pytest.raises(LookupError, match="names no request"):
        resolve("chatcmpl-", IDS)


def test_a_long_list_of_candidates_is_cut_short():
    many = [f"ab{i:030d}" for i in range(25)]
    with pytest.raises(AmbiguousId, match=r"(?s)fits 25 requests.*\.\.\. and 15 more$"):
        resolve("ab", many)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "audit.sqlite"
    store = AuditStore(path)
    for n, request_id in enumerate(IDS):
        settings = {"model": "/models/x.gguf", "model_name": "x", "params": {}}
        summary = SpeculativeEvent(
            event_id=f"{request_id}:summary", request_id=request_id, time=n + 1.0, drafted=0, accepted=0,
            acceptance_rate=0.0, iterations=1, content_length=2, finish_reason="stop", stats={}, tokens=[5],
        )  # fmt: skip
        opened = RequestOpened(
            event_id=f"{request_id}:opened", request_id=request_id, time=float(n), settings=settings,
            prompt_tokens=[1, 2],
        )  # fmt: skip
        store.add([opened, summary])
    store.close()
    return path


def test_audit_show_takes_response_ids_and_lists_the_requests_a_prefix_fits(store_path, capsys):
    assert cli.main(["audit", "show", f"chatcmpl-{IDS[2][:6]}", "--db", str(store_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["request_id"] == IDS[2] and shown["opened"]["settings"]["model_name"] == "x"
    assert cli.main(["audit", "show", "cmpl-3f2a9c0d", "--db", str(store_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("speclanes: error: 'cmpl-3f2a9c0d' fits 2 requests in the audit store")
    assert IDS[0] in error and IDS[1] in error
    assert cli.main(["audit", "verify", "chatcmpl-zz", "--db", str(store_path)]) == 2
    error = capsys.readouterr().err  # and why a request that just finished may not be there yet
    assert "no request with id 'chatcmpl-zz' in the audit store (" in error and "audit.batch_seconds" in error


def span(trace_id: str, name: str, request_id: str | None, parent: str = "") -> SpanRecord:
    attributes = {"speclanes.request_id": request_id} if request_id else {}
    return SpanRecord(
        service="speclanes-orchestrator", pid=1, trace_id=trace_id, span_id=name, parent_id=parent,
        name=name, start_ns=1, end_ns=2, attributes=attributes, events=[], status="OK", status_message="",
    )  # fmt: skip


def test_a_trace_is_found_by_request_response_or_trace_id_and_their_prefixes():
    spans = [
        span("a1" * 16, "root-a", IDS[0]), span("a1" * 16, "verify", None, "root-a"),
        span("b2" * 16, "root-b", IDS[1]), span("c3" * 16, "root-c", IDS[2]),
    ]  # fmt: skip
    assert {s.name for s in find_trace(spans, f"chatcmpl-{IDS[0]}")} == {"root-a", "verify"}
    assert find_trace(spans, "cmpl-77aa")[0].name == "root-c"
    assert find_trace(spans, "b2b2")[0].name == "root-b"  # a trace id's prefix
    with pytest.raises(AmbiguousId) as caught:
        find_trace(spans, "3f2a")
    assert IDS[0] in str(caught.value) and IDS[1] in str(caught.value)  # listed by request id
    with pytest.raises(LookupError, match="no trace or request"):
        find_trace(spans, "ffff")
