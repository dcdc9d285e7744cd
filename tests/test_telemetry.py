"""Telemetry: exporter choice from the OTEL_* environment, the OTLP/JSON file round trip,
and, against a real OTLP receiver (rotel), one request's trace across every process,
including a lane killed in the middle of it."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from pipeline.audit.store import AuditStore
from pipeline.cli import main as cli_main
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.observability.telemetry import (
    Telemetry,
    TelemetryError,
    carrier,
    check,
    exporters,
    service_name,
)
from pipeline.observability.trace_files import SpanRecord, read_spans, trace_files
from pipeline.protocol.messages import StepEvent
from pipeline.workers.step_spans import STEPS_PER_SPAN

from .pipeline_harness import Pipeline, running_pipeline
from .rotel_harness import ReceivedSpan, otlp_receiver
from .telemetry_harness import steps_of

# --- exporters from the environment ---------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, [FileSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, [OTLPSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, [OTLPSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "otlp,otlp_json_file"}, [OTLPSpanExporter, FileSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"}, []),
    ],
)
def test_trace_exporters_follow_the_standard_variables(tmp_path, environ, expected) -> None:
    found = exporters("traces", "verify", tmp_path, environ)
    assert [type(e) for e in found] == expected


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin-carrier-pigeon"}, "no exporter named"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "http/protobuf",
        ),
        ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}, "http/protobuf"),
    ],
)
def test_settings_no_process_could_honour_fail_at_start(environ, problem) -> None:
    with pytest.raises(TelemetryError, match=problem):
        check(environ)


def test_each_process_has_its_own_service_under_a_shared_namespace() -> None:
    assert service_name("verify", {}) == "speclanes-verify"
    assert service_name("draft", {"OTEL_SERVICE_NAME": "chatbot"}) == "chatbot-draft"


def test_the_file_export_reads_back_as_otlp_json_with_the_same_ids(tmp_path) -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "OTEL_METRICS_EXPORTER": "none"}
    telemetry = Telemetry.configure("orchestrator", tmp_path, "run-1", env)
    root = telemetry.start("chat model", attributes={"gen_ai.request.max_tokens": 7, "tags": ["a", "b"]})
    child = telemetry.start("verify", carrier(root), {"speclanes.acceptance": 0.5})
    child.end()
    telemetry.fault(root, "lane_down", "verify", "pid 1 exited", request_id="r1", step=3)
    root.end()
    telemetry.shutdown()
    (path,) = trace_files(tmp_path)
    assert path.name.startswith("speclanes-orchestrator.") and str(os.getpid()) in path.name
    path.write_text(path.read_text() + '{"resourceSpans": [{"cut short')  # a killed writer's last line
    spans, bad = read_spans([path])
    assert bad == 1
    by_name = {s.name: s for s in spans}
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert {s.trace_id for s in spans} == {trace_id}
    assert by_name["chat model"].parent_id == ""
    assert by_name["chat model"].attributes == {"gen_ai.request.max_tokens": 7, "tags": ["a", "b"]}
    assert by_name["verify"].parent_id == format(root.get_span_context().span_id, "016x")
    assert by_name["verify"].attributes == {"speclanes.acceptance": 0.5}
    fault = by_name["fault lane_down"]
    assert (fault.status, fault.parent_id) == ("ERROR", by_name["verify"].parent_id)
    assert fault.events[0]["name"] == "speclanes.fault"
    assert fault.events[0]["speclanes.fault.message"] == "pid 1 exited"
    assert by_name["verify"].service == "speclanes-orchestrator"


def test_speclanes_trace_lists_and_shows_a_trace_from_the_files(tmp_path, capsys) -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "OTEL_METRICS_EXPORTER": "none"}
    telemetry = Telemetry.configure("orchestrator", tmp_path, "run-1", env)
    root = telemetry.start(
        "chat m", attributes={"gen_ai.operation.name": "chat", "speclanes.request_id": "r9"}
    )
    telemetry.start("verify", root, {"speclanes.step": 1, "speclanes.k": 4, "speclanes.accepted": 3}).end()
    root.end()
    telemetry.shutdown()
    assert cli_main(["trace", "--dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "r9" in listing and format(root.get_span_context().trace_id, "032x") in listing
    assert cli_main(["trace", "r9", "--dir", str(tmp_path)]) == 0
    tree = capsys.readouterr().out.splitlines()
    assert "chat m [speclanes-orchestrator]" in tree[0]
    assert tree[1].split("ms", 2)[2].startswith("    verify") and "step=1 k=4 accepted=3" in tree[1]
    assert cli_main(["trace", "nope", "--dir", str(tmp_path)]) == 2


# --- one pipeline, traced end to end ----------------------------------------------------

QUOTE = (
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog "
    "while the cat watches from the warm windowsill."
)
PROCESSES = {"speclanes-orchestrator", "speclanes-verify", "speclanes-draft", "speclanes-audit"}


class Scenario:
    """What one traced pipeline run produced: a plain request and one whose verify lane
    was SIGKILLed mid-stream, as a real OTLP receiver and the file export saw them."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.plain: dict = {}
        self.killed: dict = {}
        self.killed_pid = 0
        self.received: list[ReceivedSpan] = []
        self.files: list[SpanRecord] = []
        self.bad_lines = 0
        self.steps: dict[str, list[StepEvent]] = {}

    def run(self) -> None:
        with self.pipeline.client() as client:
            self.plain = client.complete(
                QUOTE, chat=True, params=SamplingParams(max_tokens=40), drafter="ngram"
            )
            # The plain request must be undisturbed in its trace too: let its spans leave every
            # process (batches go every 200 ms here) before the next request's verify lane is killed.
            time.sleep(1.5)
            self.killed = self.run_with_a_kill(client)

    def run_with_a_kill(self, client) -> dict:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        request_id = client.submit(QUOTE, chat=True, params=params, drafter="ngram").request_id
        emitted, done = 0, None
        for item in client.chunks(request_id):
            if isinstance(item, Result):
                done = item
                continue
            emitted += len(item.tokens)
            if emitted >= 12 and not self.killed_pid:
                self.killed_pid = self.pipeline.lane("verify").pid or 0
                os.kill(self.killed_pid, signal.SIGKILL)
        assert done is not None
        return done

    def collect(self, receiver) -> None:
        self.pipeline.wait_until(lambda report: report.audit_pending == 0, what="every audit event stored")
        store = AuditStore(self.pipeline.config.audit.path)
        for done in (self.plain, self.killed):
            events = store.events(done.request_id)
            self.steps[done.request_id] = [e for e in events if isinstance(e, StepEvent)]
        store.close()
        self.pipeline.stop()  # SIGTERM: every surviving process flushes its spans
        deadline, count = time.monotonic() + 10, -1
        while time.monotonic() < deadline:  # until the receiver has logged everything it got
            time.sleep(0.3)
            self.received = receiver.spans()
            if len(self.received) == count:
                break
            count = len(self.received)
        self.files, self.bad_lines = read_spans(trace_files(Path(self.pipeline.config.telemetry.dir)))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    directory = tmp_path_factory.mktemp("traced")
    with otlp_receiver(directory) as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
            "OTEL_TRACES_EXPORTER": "otlp,otlp_json_file",  # the receiver and the default files at once
            "OTEL_METRICS_EXPORTER": "otlp_json_file",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        settings = ["gateway.enabled=false", "restart.initial_backoff=0.1", "timeouts.draft=5.0"]
        with running_pipeline(directory / "run", settings, env) as pipeline:
            scenario = Scenario(pipeline)
            scenario.run()
            scenario.collect(receiver)
    return scenario


def trace_of(spans, request_id: str) -> list:
    ids = {s.trace_id for s in spans if s.attributes.get("speclanes.request_id") == request_id}
    assert len(ids) == 1, f"request {request_id} is in {len(ids)} traces"
    return [s for s in spans if s.trace_id in ids]


def assert_well_parented(trace: list) -> object:
    by_id = {s.span_id: s for s in trace}
    roots = [s for s in trace if not s.parent_id]
    assert len(roots) == 1, [s.name for s in roots]
    assert all(s.parent_id in by_id for s in trace if s.parent_id), "a span's parent never arrived"
    return roots[0]


@pytest.mark.slow
def test_one_request_is_one_trace_with_spans_from_every_lane(scenario: Scenario) -> None:
    done = scenario.plain
    trace = trace_of(scenario.received, done.request_id)
    root = assert_well_parented(trace)
    assert {s.service for s in trace} == PROCESSES - {"speclanes-draft"}  # ngram drafts in the verify lane
    assert root.service == "speclanes-orchestrator"
    assert root.name == "chat SmolLM2-135M-Instruct.Q4_1"
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert int(attrs["gen_ai.request.max_tokens"]) == 40 and float(attrs["gen_ai.request.temperature"]) == 0
    assert attrs["gen_ai.usage.input_tokens"] == str(len(done.prompt_tokens))
    assert attrs["gen_ai.usage.output_tokens"] == str(len(done.tokens))
    assert done.finish_reason in attrs["gen_ai.response.finish_reasons"]
    assert attrs["speclanes.drafter"] == "ngram"
    names = Counter((s.service, s.name) for s in trace)
    steps = done.stats.steps
    assert names[("speclanes-verify", "prefill")] == 1
    assert names[("speclanes-verify", "verify")] == -(-steps // STEPS_PER_SPAN)  # a span per run of steps
    assert names[("speclanes-orchestrator", "queue")] == 1
    verify = [e for s in trace if s.name == "verify" for e in steps_of(s.attributes)]
    assert sorted(int(e["number"]) for e in verify) == list(range(1, steps + 1))
    wanted = {"start_us", "k", "accepted", "batch_size", "batch_rows", "emitted"}
    assert all(wanted <= set(event) for event in verify)
    assert sum(int(e["accepted"]) for e in verify) == done.stats.accepted
    drafts = [e for s in trace if s.name == "draft" for e in steps_of(s.attributes)]  # a span per run, too
    assert drafts and all(e["drafter"] == "ngram" for e in drafts if not e["failed"])
    assert names[("speclanes-verify", "draft")] == -(-len(drafts) // STEPS_PER_SPAN)
    assert names[("speclanes-audit", "audit persist")] >= 1
    assert all(s.status != "ERROR" for s in trace)


@pytest.mark.slow
def test_the_file_export_gives_the_same_trace(scenario: Scenario) -> None:
    """Identical for the undisturbed request. For the other, identical but for the SIGKILLed
    verify lane's spans: its two exporters flush on their own timers, so one may have sent a
    batch the other had not when the kill came."""
    assert scenario.bad_lines == 0
    for done, skip_pid in ((scenario.plain, None), (scenario.killed, scenario.killed_pid)):
        received = trace_of(scenario.received, done.request_id)
        filed = trace_of(scenario.files, done.request_id)
        assert_well_parented(filed)
        assert shape(filed, skip_pid) == shape(received, skip_pid)
        assert steps_in(filed, skip_pid) == steps_in(received, skip_pid)
        if skip_pid is None:  # the undisturbed request: every step has its event in a verify span
            verified = sorted(step for name, _, step in steps_in(filed, None) if name == "verify")
            assert verified == list(range(1, done.stats.steps + 1))


def steps_in(spans: list, skip_pid: int | None) -> list[tuple]:
    """Each step (verify and draft runs, from their columns) as (span name, span id, step)."""
    found = [
        (s.name, s.span_id, int(e["number"]))
        for s in spans
        if s.pid != skip_pid
        for e in steps_of(s.attributes)
    ]
    return sorted(found)


def shape(spans: list, skip_pid: int | None) -> list[tuple]:
    return sorted((s.service, s.span_id, s.parent_id, s.name, s.status) for s in spans if s.pid != skip_pid)


@pytest.mark.slow
def test_a_killed_lane_shows_as_a_fault_and_a_restart_and_survivors_lose_no_span(scenario: Scenario) -> None:
    done = scenario.killed
    assert done.error is None and len(done.tokens) == 60
    trace = trace_of(scenario.files, done.request_id)
    root = assert_well_parented(trace)
    assert root.status != "ERROR"  # the request survived the fault
    faults = [s for s in trace if s.name == "fault lane_down"]
    assert faults and all(s.status == "ERROR" for s in faults)
    assert faults[0].attributes["speclanes.lane"] == "verify"
    assert f"pid {scenario.killed_pid} " in faults[0].events[0]["speclanes.fault.message"]
    (restart,) = [s for s in trace if s.name == "lane restart verify"]
    assert restart.attributes["speclanes.lane.pid"] == scenario.killed_pid
    assert restart.attributes["speclanes.lane.new_pid"] not in (0, scenario.killed_pid)
    assert restart.parent_id == root.span_id and restart.end_ns > restart.start_ns
    assert [s.name for s in trace if s.name == "reprime"] == ["reprime"]
    supervisor = [
        s for s in scenario.files if s.name == "lane restart verify" and s.service.endswith("supervisor")
    ]
    assert [s.attributes["speclanes.lane.pid"] for s in supervisor] == [scenario.killed_pid]
    # The replacement verify lane's spans cover every step after the restart.
    steps = scenario.steps[done.request_id]
    verified_after = sorted(
        int(e["number"])
        for s in trace
        if s.name == "verify" and s.start_ns > restart.end_ns
        for e in steps_of(s.attributes)
    )
    last = max(e.step for e in steps)
    assert verified_after and verified_after == list(range(verified_after[0], last + 1))
    # So do its draft spans (ngram drafts in the verify lane), for every step drafted after the restart;
    # the killed lane's may be lost with it, as its verify spans may.
    drafted = sorted(e.step for e in steps if e.drafter and e.step >= verified_after[0])
    assert drafted, "ngram drafted nothing after the restart: the scenario tests nothing"
    spans = {int(e["number"]) for s in trace if s.name == "draft" for e in steps_of(s.attributes)}
    assert set(drafted) <= spans


@pytest.mark.slow
def test_metrics_are_exported_by_the_orchestrator(scenario: Scenario) -> None:
    directory = Path(scenario.pipeline.config.telemetry.dir)
    text = "".join(p.read_text() for p in directory.glob("speclanes-orchestrator.*.metrics.jsonl"))
    for name in (
        "speclanes.tokens.drafted",
        "speclanes.tokens.accepted",
        "speclanes.step.accepted_drafts",
        "speclanes.step.accepted_length",
        "speclanes.step.duration",
        "gen_ai.server.time_to_first_token",
        "speclanes.request.output_tokens_per_second",
        "speclanes.requests.active",
    ):
        assert f'"{name}"' in text, name
    restarts = "".join(p.read_text() for p in directory.glob("speclanes-supervisor.*.metrics.jsonl"))
    assert '"speclanes.lane.restarts"' in restarts
