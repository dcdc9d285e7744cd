"""The orchestrator's metrics in the Prometheus text format, without processes: whole requests
through the orchestrator's core (tests/orchestration_harness.py) with the Prometheus exposition the
orchestrator lane attaches, parsed back with prometheus_client's own parser and compared with
`status`, the audit events and the requests' results. Then the Grafana dashboard in ops/grafana
must name only series this exposition has. The same exposition through a real pipeline's gateway
(`GET /metrics`) is checked in tests/test_gateway.py."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import get_args

import pytest
import yaml
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client.parser import text_string_to_metric_families

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model
from pipeline.observability.metrics import PipelineMetrics
from pipeline.observability.prometheus import PrometheusExposition
from pipeline.observability.telemetry import TelemetryError, check
from pipeline.orchestration.tracing import FAULT_LANES, OUTCOMES
from pipeline.protocol.messages import Fault, FaultKind, RequestOpened, StepEvent

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf

DASHBOARD = Path(__file__).resolve().parent.parent / "ops" / "grafana" / "speclanes.json"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPT = "ab ab ab ab cd cd"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("metrics") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample by its name (`..._total`, `..._bucket`, `..._sum`...), labels and value."""
    out: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((sample.labels, sample.value))
    return out


def total(found: dict, name: str, **labels: str) -> float:
    return sum(v for got, v in found.get(name, []) if all(got.get(k) == x for k, x in labels.items()))


def by_label(found: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for labels, value in found.get(name, []):
        out[labels[label]] += value
    return dict(out)


@pytest.fixture(scope="module")
def scenario(model):
    """Requests with and without drafts, a fault a lane reports, a draft lane that died and came back
    (drafting there: `World.paced`)."""
    exposition = PrometheusExposition()
    world = World.paced(model, readers=[exposition.reader])
    world.up()
    ids = [world.submit(PROMPT, params=GREEDY, drafter=d, k=4) for d in ("ngram", "ngram", "none")]
    world.run()
    lane_fault = Fault(kind="draft_failed", lane="draft", message="a lane's own report", time=1.0)
    world.feed(world.hub.on_control(lane_fault, world.now))
    world.down("draft")
    world.run()
    world.up("draft")
    ids.append(world.submit(PROMPT, params=GREEDY, drafter="ngram", k=3))
    world.run()
    results = [world.result(i) for i in ids]
    assert all(isinstance(r, Result) and r.error is None for r in results)
    world.hub.tracing.metrics.flush()  # as the orchestrator does before it answers a MetricsQuery
    return world, results, samples(exposition.text())


def test_counters_agree_with_status_the_results_and_the_audit_events(scenario):
    world, results, found = scenario
    status = world.hub.status()
    drafted, accepted = (
        total(found, "speclanes_tokens_drafted_total"),
        total(found, "speclanes_tokens_accepted_total"),
    )
    assert (
        (drafted, accepted)
        == (status.totals.drafted, status.totals.accepted)
        == (
            sum(r.stats.drafted for r in results),
            sum(r.stats.accepted for r in results),
        )
    )
    assert accepted > 0 and by_label(found, "speclanes_tokens_drafted_total", "speclanes_drafter").keys() >= {
        "ngram"
    }
    steps = sum(r.stats.steps for r in results)
    assert total(found, "speclanes_step_accepted_length_count") == steps
    assert (
        total(found, "speclanes_step_accepted_length_sum") == accepted + steps
    )  # mean: (accepted + steps) / steps
    assert total(found, "gen_ai_server_request_duration_seconds_count") == len(results) == status.totals.runs
    assert total(found, "gen_ai_server_time_to_first_token_seconds_count") == len(results)
    assert total(found, "speclanes_request_output_tokens_per_second_count") == len(results)
    output = sum(len(r.tokens) for r in results)
    assert total(found, "speclanes_tokens_usage_total", gen_ai_token_type="output") == output
    prompts = [e for e in world.audited.values() if isinstance(e, RequestOpened)]
    assert total(found, "speclanes_tokens_usage_total", gen_ai_token_type="input") == sum(
        len(e.prompt_tokens) for e in prompts
    )
    lanes = by_label(found, "speclanes_step_duration_seconds_count", "speclanes_lane")
    assert lanes["verify"] == steps and 0 < lanes["draft"] <= steps


def test_outcomes_and_request_times_agree_with_status_and_the_results(scenario):
    """How each request ended, its queue, prefill and per-token times, with the GenAI conventions'
    labels on their instruments."""
    world, results, found = scenario
    outcomes = {
        (got["speclanes_outcome"], got["gen_ai_response_finish_reasons"]): value
        for got, value in found["speclanes_requests_total"]
    }
    assert outcomes.keys() == {(o, reason) for o, reasons in OUTCOMES.items() for reason in reasons}
    finished = by_label(found, "speclanes_requests_total", "speclanes_outcome")
    assert finished == {"finished": len(results), "aborted": 0, "error": 0}
    assert finished["finished"] + finished["aborted"] == world.hub.status().totals.runs
    for name in (
        "speclanes_request_queue_time_seconds_count",
        "speclanes_request_prefill_time_seconds_count",
    ):
        assert total(found, name) == len(results), name
    tpot = [(r.stats.wall_seconds - r.stats.prefill_seconds) / (len(r.tokens) - 1) for r in results]
    assert total(found, "gen_ai_server_time_per_output_token_seconds_count") == len(results)
    assert total(found, "gen_ai_server_time_per_output_token_seconds_sum") == pytest.approx(sum(tpot))
    queued = total(found, "speclanes_request_queue_time_seconds_sum")
    prefill = total(found, "speclanes_request_prefill_time_seconds_sum")
    first = total(found, "gen_ai_server_time_to_first_token_seconds_sum")
    assert prefill > 0 and queued + prefill == pytest.approx(first)  # the first token's time, split in two
    genai = {"gen_ai_operation_name": "text_completion", "gen_ai_provider_name": "speclanes"}
    for name in (
        "gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_request_duration_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_count",
    ):  # fmt: skip
        assert total(found, name, **genai) == total(found, name) == len(results), name


def test_acceptance_by_position_is_counted_from_every_step(scenario):
    world, results, found = scenario
    want_drafted, want_accepted = collections.Counter(), collections.Counter()
    for event in world.audited.values():
        if isinstance(event, StepEvent):
            kept = sum(d.kept for d in event.decisions)
            want_drafted.update(str(i) for i in range(len(event.drafted)))
            want_accepted.update(str(i) for i in range(kept))
    assert by_label(found, "speclanes_position_drafted_total", "speclanes_position") == want_drafted
    assert by_label(found, "speclanes_position_accepted_total", "speclanes_position") == want_accepted
    # The per-request figure is the same ratio over one request's steps.
    first = results[0].stats.per_position_acceptance
    assert len(first) > 0 and all(0.0 <= a <= 1.0 for a in first)


def test_faults_restarts_and_lanes_agree_with_status(scenario):
    world, _, found = scenario
    status = world.hub.status()
    kinds = collections.Counter(f.kind for f in status.faults)
    counted = by_label(found, "speclanes_faults_total", "speclanes_fault_kind")
    assert {kind: n for kind, n in counted.items() if n} == kinds
    # Every kind on every lane is a series from the start, at 0 until it happens.
    series = {
        (got["speclanes_fault_kind"], got["speclanes_lane"]) for got, _ in found["speclanes_faults_total"]
    }
    assert series == {(kind, lane) for kind in get_args(FaultKind) for lane in FAULT_LANES}
    assert kinds["draft_failed"] == 1 and kinds["lane_down"] == 1  # the lane's own report is counted too
    restarts = by_label(found, "speclanes_lane_restarts_total", "speclanes_lane")
    assert restarts == {lane.name: lane.restarts for lane in status.lanes} and restarts["draft"] == 1
    up = by_label(found, "speclanes_lane_up", "speclanes_lane")
    assert up == {lane.name: float(lane.state == "up") for lane in status.lanes}
    assert total(found, "speclanes_requests_active") == total(found, "speclanes_requests_queued") == 0
    assert total(found, "speclanes_audit_pending") == status.audit_pending == 0


def test_steps_are_held_off_the_bursts_and_recorded_summed_by_drafter_at_a_flush():
    """A step's figures wait in a list (`PipelineMetrics.step`) until a tick or a scrape flushes them."""
    exposition = PrometheusExposition()
    metrics = PipelineMetrics(MeterProvider(metric_readers=[exposition.reader]).get_meter("t"), "tiny")
    for drafted, accepted in ((4, 3), (4, 1), (0, 0)):
        metrics.step("ngram" if drafted else "none", drafted, accepted, 0.001 if drafted else 0.0, 0.005)
    assert total(samples(exposition.text()), "speclanes_step_accepted_length_count") == 0
    metrics.flush()
    found = samples(exposition.text())
    assert by_label(found, "speclanes_tokens_drafted_total", "speclanes_drafter") == {"ngram": 8, "none": 0}
    assert by_label(found, "speclanes_tokens_accepted_total", "speclanes_drafter") == {"ngram": 4, "none": 0}
    assert total(found, "speclanes_step_accepted_length_count") == 3
    assert total(found, "speclanes_step_accepted_length_sum") == 4 + 2 + 1
    assert by_label(found, "speclanes_step_duration_seconds_count", "speclanes_lane") == {
        "draft": 2,
        "verify": 3,
    }
    metrics.flush()  # nothing held: nothing counted twice
    assert total(samples(exposition.text()), "speclanes_step_accepted_length_count") == 3


def test_active_and_queued_are_what_status_shows_at_the_scrape(model):
    exposition = PrometheusExposition()
    world = World.paced(model, {"admission": {"max_running": 1}}, readers=[exposition.reader])
    world.up()
    first, second = world.submit(PROMPT, params=GREEDY), world.submit(PROMPT, params=GREEDY)
    found, status = samples(exposition.text()), world.hub.status()
    assert (status.active_requests, status.queued_requests) == (1, 1)
    assert total(found, "speclanes_requests_active") == 1 and total(found, "speclanes_requests_queued") == 1
    assert total(found, "speclanes_audit_pending") == status.audit_pending > 0  # nothing acknowledged yet
    world.run(until=12)  # some steps of the first decided and journaled; the second waits
    held = len(world.hub.front.machine(first).session.context)
    found, capacity = samples(exposition.text()), model.cfg.context_length  # one running place
    assert 0 < held < capacity and world.result(first) is None
    assert total(found, "speclanes_kv_cache_tokens") == held
    assert total(found, "speclanes_kv_cache_capacity") == capacity
    assert total(found, "speclanes_kv_cache_usage") == pytest.approx(held / capacity)
    world.feed(world.hub.cancel(second, world.secrets[second], world.now)[1])  # ended while queued
    world.run()
    found = samples(exposition.text())
    assert total(found, "speclanes_requests_active") == total(found, "speclanes_requests_queued") == 0
    assert world.result(first) is not None
    assert total(found, "speclanes_kv_cache_tokens") == total(found, "speclanes_kv_cache_usage") == 0
    ended = by_label(found, "speclanes_requests_total", "gen_ai_response_finish_reasons")
    assert (ended["length"], ended["cancelled"]) == (1, 1)
    assert total(found, "speclanes_requests_total", speclanes_outcome="aborted") == 1
    assert total(found, "speclanes_request_queue_time_seconds_count") == 1  # the second never left the queue


def test_the_prometheus_exporter_is_refused_in_favour_of_the_gateway():
    with pytest.raises(TelemetryError, match="GET /metrics"):
        check({"OTEL_METRICS_EXPORTER": "prometheus"})


# --- the relabelling for vLLM dashboards (docs/operations.md) -------------------------------

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
VLLM_SERIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    *(f"vllm:{h}_seconds_{s}" for s in ("bucket", "sum", "count") for h in (
        "time_to_first_token", "time_per_output_token", "e2e_request_latency", "request_queue_time",
        "request_prefill_time")),
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}  # fmt: skip


def relabel_rules() -> list[dict]:
    """The `metric_relabel_configs` of the documented scrape job."""
    text = OPERATIONS.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    jobs = [job for block in blocks for job in yaml.safe_load(block).get("scrape_configs", [])]
    (job,) = [job for job in jobs if "metric_relabel_configs" in job]
    return job["metric_relabel_configs"]


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str]:
    """Prometheus's `replace` and `labelmap` actions: regexes anchored at both ends, `$1` and `${1}`
    for groups, source label values joined by `;`."""
    labels = dict(labels)
    for rule in rules:
        regex = re.compile(rule["regex"])
        replacement = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule["replacement"])
        if rule.get("action", "replace") == "labelmap":
            mapped = {regex.sub(replacement, k): v for k, v in labels.items() if regex.fullmatch(k)}
            labels.update(mapped)
            continue
        assert rule.get("action", "replace") == "replace", rule
        if (match := regex.fullmatch(";".join(labels.get(n, "") for n in rule["source_labels"]))) is not None:
            labels[rule["target_label"]] = match.expand(replacement)
    return labels


def test_the_documented_relabelling_gives_the_series_vllm_dashboards_read(scenario):
    _, results, found = scenario
    rules, renamed = relabel_rules(), collections.defaultdict(list)
    for name, values in found.items():
        for got, value in values:
            labels = relabel({**got, "__name__": name}, rules)
            renamed[labels["__name__"]].append((labels, value))
    assert renamed.keys() >= VLLM_SERIES, sorted(VLLM_SERIES - renamed.keys())
    assert all(labels["model_name"] == "tiny" for labels, _ in renamed["vllm:prompt_tokens_total"])
    success = {labels["finished_reason"]: value for labels, value in renamed["vllm:request_success_total"]}
    assert success == {"stop": 0, "length": len(results), "max_iterations_exceeded": 0}
    assert total(renamed, "vllm:generation_tokens_total") == sum(len(r.tokens) for r in results)
    positions = by_label(renamed, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert positions == by_label(found, "speclanes_position_accepted_total", "speclanes_position")


# --- the Grafana dashboard ------------------------------------------------------------------

SERIES = re.compile(r"\b(?:speclanes|gen_ai)_[a-z0-9_]+")
MATCHERS = re.compile(r"\{([^}]*)\}")  # {label="value", ...}
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard_queries() -> list[str]:
    """Every PromQL query the dashboard runs: its panels' targets and its variables."""
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v["query"], dict)]
    assert len(queries) >= 12
    return queries


def referenced(query: str) -> tuple[set[str], set[str]]:
    """The series names and the label names a query uses."""
    labels = {
        m.split("=")[0].strip().rstrip("!~") for group in MATCHERS.findall(query) for m in group.split(",")
    }
    labels |= {name.strip() for group in GROUPING.findall(query) for name in group.split(",")}
    bare = GROUPING.sub("", MATCHERS.sub("", query))
    labels |= set(re.findall(r"label_values\([^,]+,\s*(\w+)\)", query))
    return set(SERIES.findall(bare)) - labels, labels - {""}


def test_the_dashboard_names_only_series_and_labels_the_exposition_has(scenario):
    _, _, found = scenario
    series, labels = set(), set()
    for query in dashboard_queries():
        names, used = referenced(query)
        series |= names
        labels |= used
    assert series <= set(found), sorted(series - set(found))
    exposed_labels = {label for values in found.values() for got, _ in values for label in got}
    assert labels <= exposed_labels, sorted(labels - exposed_labels)
    # Every instrument the brief asks a dashboard for has a panel.
    for wanted in (
        "speclanes_tokens_accepted_total", "speclanes_step_accepted_length_sum",
        "speclanes_position_accepted_total", "gen_ai_server_time_to_first_token_seconds_bucket",
        "speclanes_tokens_usage_total", "speclanes_requests_queued", "speclanes_requests_active",
        "speclanes_faults_total", "speclanes_lane_restarts_total", "speclanes_step_duration_seconds_bucket",
        "speclanes_kv_cache_usage", "speclanes_requests_total", "speclanes_request_queue_time_seconds_bucket",
        "speclanes_request_prefill_time_seconds_bucket", "gen_ai_server_time_per_output_token_seconds_bucket",
    ):  # fmt: skip
        assert wanted in series, wanted


def test_a_misspelt_series_or_label_would_be_caught():
    names, labels = referenced(
        'sum by (speclanes_lane) (rate(speclanes_tokens_accepted{gen_ai_request_model=~"$m"}[5m]))'
    )
    assert names == {"speclanes_tokens_accepted"} and labels == {"speclanes_lane", "gen_ai_request_model"}


def test_the_dashboard_is_importable_grafana_json():
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for panel in board["panels"]:
        assert {"type", "title", "gridPos"} <= panel.keys(), panel.get("title")
        for target in panel.get("targets", []):
            assert target["datasource"] == datasource and target["refId"]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model"]
