"""The orchestrator's metrics, through the OpenTelemetry metrics SDK.

The orchestrator sees every step of every request, so the speculation figures are
counted there once, whatever lane did the work: drafted and accepted tokens, acceptance
by draft position, accepted length per step (its mean is the figure vLLM reports),
step latency by lane as the request experiences it, time to first token, tokens/s and
faults. What the orchestrator holds as state (requests decoding and queued, audit events
pending, each lane's restarts and whether it is up, each process's CPU and memory as its
heartbeat reported them: observability/process_stats.py) is read when metrics are collected
(`observe`), so it is what `status` shows, whatever happened in between. Names follow the
GenAI semantic conventions where one exists. The same instruments go out over OTLP and,
through the gateway's `/metrics`, in the Prometheus format (observability/prometheus.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from pipeline.observability.process_stats import ProcessStats, observe_processes
from pipeline.observability.serving_metrics import ServingMetrics

# Bucket edges in seconds for step latencies (tens of ms per forward) and request times.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
MAX_POSITIONS = 32  # draft positions counted (k is at most 32): bounded label values


@dataclass(frozen=True)
class LaneGauge:
    up: bool
    restarts: int
    pid: int | None = None
    process: ProcessStats | None = None  # its own figures, from its last heartbeat


@dataclass(frozen=True)
class PipelineGauges:
    """What the orchestrator holds now, as `status` reports it."""

    running: int = 0  # requests decoding
    queued: int = 0  # admitted, waiting for a running place
    audit_pending: int = 0  # audit events not yet acknowledged
    prompt_tokens_reused: int = 0  # prompt positions the verify lane copied, since it started
    lanes: dict[str, LaneGauge] = field(default_factory=dict)
    verify_loop_seconds: dict[str, float] = field(default_factory=dict)  # by phase, since the lane started


@dataclass(frozen=True)
class HeldStep:
    """One verify step's figures, until `PipelineMetrics.flush` records them."""

    drafter: str
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float


class PositionTally:
    """Draft tokens proposed and kept at each draft position, summed in plain lists: a step adds
    to at most 2k numbers here, where a counter call per position would cost ~10 µs each on the
    step's critical path. Exported as observable counters when metrics are collected."""

    def __init__(self) -> None:
        self.drafted = [0] * MAX_POSITIONS
        self.accepted = [0] * MAX_POSITIONS

    def add(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, MAX_POSITIONS)):
            self.drafted[i] += 1
        for i in range(min(accepted, MAX_POSITIONS)):
            self.accepted[i] += 1


class PipelineMetrics:
    def __init__(self, meter: Meter, model: str) -> None:
        self.base = {"gen_ai.request.model": model}
        # The GenAI conventions require these two of their instruments; each call adds the operation.
        self.genai = {**self.base, "gen_ai.provider.name": "speclanes"}
        self.serving = ServingMetrics(meter, self.base, self.genai)  # outcomes, queue, prefill, KV cache
        self.drafted = meter.create_counter(
            "speclanes.tokens.drafted", "{token}", "Draft tokens sent to the verifier"
        )
        self.accepted = meter.create_counter(
            "speclanes.tokens.accepted", "{token}", "Draft tokens the verifier kept"
        )
        self.accepted_drafts = meter.create_histogram(
            "speclanes.step.accepted_drafts",
            "{token}",
            "Drafts kept per verify step, by how many were drafted (speclanes.drafted). Acceptance at "
            "position i is the share of steps with more than i drafted that kept more than i: one "
            "record per step instead of one per position",
            explicit_bucket_boundaries_advisory=[n + 0.5 for n in range(33)],
        )
        self.accepted_length = meter.create_histogram(
            "speclanes.step.accepted_length",
            "{token}",
            "Tokens emitted per verify step (accepted drafts + 1); its mean is the mean accepted length",
            explicit_bucket_boundaries_advisory=[float(n) for n in range(1, 34)],
        )
        self.step_duration = meter.create_histogram(
            "speclanes.step.duration",
            "s",
            "One step's wait for its drafts (speclanes.lane=draft, wherever they were made) or its verify"
            " forward (verify), as the request sees it",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS,
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            "s",
            "Time from admission to the first generated token (prefill included)",
            explicit_bucket_boundaries_advisory=REQUEST_BUCKETS,
        )
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            "s",
            "Time from admission to the request's end",
            explicit_bucket_boundaries_advisory=REQUEST_BUCKETS,
        )
        self.tokens_per_second = meter.create_histogram(
            "speclanes.request.output_tokens_per_second",
            "{token}/s",
            "Generated tokens over the request's wall time, prefill included",
        )
        self.token_usage = meter.create_counter(
            "speclanes.tokens.usage", "{token}", "Prompt (input) and generated (output) tokens"
        )
        self.faults = meter.create_counter("speclanes.faults", "{fault}", "Faults by kind and lane")
        self.lane_attributes = {lane: {**self.base, "speclanes.lane": lane} for lane in ("draft", "verify")}
        self.positions = PositionTally()
        self.held: list[HeldStep] = []  # steps not yet recorded (`step`, `flush`)
        self.drafter_attributes: dict[str, dict[str, str]] = {}
        self.read: Callable[[], PipelineGauges] = PipelineGauges  # until `observe` names the source
        self._observed(meter)

    def _observed(self, meter: Meter) -> None:
        """Instruments read when metrics are collected (an export or a `/metrics` scrape)."""
        now = meter.create_observable_up_down_counter
        now(
            "speclanes.requests.active",
            [self._one(lambda g: g.running)],
            "{request}",
            "Requests decoding now (admitted, not queued, not finished)",
        )
        now(
            "speclanes.requests.queued",
            [self._one(lambda g: g.queued)],
            "{request}",
            "Requests admitted and waiting for one of admission.max_running places",
        )
        now(
            "speclanes.audit.pending",
            [self._one(lambda g: g.audit_pending)],
            "{event}",
            "Audit events the audit lane has not yet acknowledged",
        )
        meter.create_observable_counter(
            "speclanes.prompt.reused_tokens",
            [self._one(lambda g: g.prompt_tokens_reused)],
            "{token}",
            "Prompt tokens whose K/V the verify lane copied from another request's cache instead of "
            "computing them (the choices of a request with n > 1, shared prefixes); since the lane started",
        )
        meter.create_observable_counter(
            "speclanes.verify.loop_time",
            [self._loop_phases],
            "s",
            "Seconds the verify lane spent in each phase of its loop (speclanes.phase: forward, "
            "bookkeeping, checkpoint, drafting, draft_wait, report, pause, held); since the lane started",
        )
        meter.create_observable_counter(
            "speclanes.lane.restarts",
            [self._lane_restarts],
            "{restart}",
            "Times the supervisor restarted each process after it died (as `status` shows)",
        )
        meter.create_observable_gauge(
            "speclanes.lane.up",
            [self._lanes_up],
            "1",
            "1 while the process is up, else 0 (starting, stalled, down or failed)",
        )
        meter.create_observable_counter(
            "speclanes.position.drafted",
            [self._position(self.positions.drafted)],
            "{token}",
            "Draft tokens proposed at each draft position (speclanes.position, from 0)",
        )
        meter.create_observable_counter(
            "speclanes.position.accepted", [self._position(self.positions.accepted)], "{token}",
            "Draft tokens kept at each draft position; over speclanes.position.drafted, the "
            "acceptance by position")  # fmt: skip
        observe_processes(meter, self._processes)

    def observe(self, read: Callable[[], PipelineGauges]) -> None:
        """Where the state-like instruments read from (the orchestrator's hub)."""
        self.read = read

    def _one(
        self, pick: Callable[[PipelineGauges], int]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return lambda options: [Observation(pick(self.read()), self.base)]

    def _lane_restarts(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(lane.restarts, {**self.base, "speclanes.lane": name})
            for name, lane in self.read().lanes.items()
        ]

    def _loop_phases(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(seconds, {**self.base, "speclanes.phase": phase})
            for phase, seconds in self.read().verify_loop_seconds.items()
        ]

    def _lanes_up(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(int(lane.up), {**self.base, "speclanes.lane": name})
            for name, lane in self.read().lanes.items()
        ]

    def _processes(self) -> list[tuple[dict[str, str | int], ProcessStats]]:
        """Every running process's figures, labelled by its lane and pid (`process_*` in Prometheus)."""
        return [
            ({**self.base, "speclanes.lane": name, "process.pid": lane.pid or 0}, lane.process)
            for name, lane in self.read().lanes.items() if lane.process is not None
        ]  # fmt: skip

    def _position(self, counts: list[int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(count, {**self.base, "speclanes.position": i})
                for i, count in enumerate(counts) if count
            ]  # fmt: skip

        return observe

    def admitted(self, prompt_tokens: int) -> None:
        self.token_usage.add(prompt_tokens, {**self.base, "gen_ai.token.type": "input"})

    def first_token(self, seconds: float, operation: str) -> None:
        self.ttft.record(seconds, {**self.genai, "gen_ai.operation.name": operation})

    def step(
        self, drafter: str, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """Held, not recorded: a step is handled in the burst that journals it and wakes the polls
        that stream it, and its four to six instrument calls (~15 µs each) were a third of that
        handling. `flush` records what is held, every orchestrator tick and before any collection."""
        self.held.append(HeldStep(drafter or "none", drafted, accepted, draft_seconds, verify_seconds))

    def flush(self) -> None:
        """Every held step into the instruments: the counters once per drafter, summed, and the
        histograms once per step (a histogram takes one value a call)."""
        held, self.held = self.held, []
        sums: dict[str, list[int]] = {}
        for step in held:
            attrs = self.drafter_attributes.setdefault(
                step.drafter, {**self.base, "speclanes.drafter": step.drafter}
            )
            total = sums.setdefault(step.drafter, [0, 0])
            total[0] += step.drafted
            total[1] += step.accepted
            if step.drafted:
                self.accepted_drafts.record(step.accepted, {**attrs, "speclanes.drafted": step.drafted})
                self.positions.add(step.drafted, step.accepted)
            self.accepted_length.record(step.accepted + 1, attrs)
            if step.draft_seconds:
                self.step_duration.record(step.draft_seconds, self.lane_attributes["draft"])
            self.step_duration.record(step.verify_seconds, self.lane_attributes["verify"])
        for drafter, (drafted, accepted) in sums.items():
            self.drafted.add(drafted, self.drafter_attributes[drafter])
            self.accepted.add(accepted, self.drafter_attributes[drafter])

    def finished(self, output_tokens: int, seconds: float, finish_reason: str, operation: str) -> None:
        attrs = {**self.base, "gen_ai.response.finish_reasons": finish_reason}
        self.token_usage.add(output_tokens, {**self.base, "gen_ai.token.type": "output"})
        self.request_duration.record(seconds, {**attrs, **self.genai, "gen_ai.operation.name": operation})
        if seconds > 0:
            self.tokens_per_second.record(output_tokens / seconds, attrs)

    def fault(self, kind: str, lane: str, count: int = 1) -> None:
        self.faults.add(count, {"speclanes.fault.kind": kind, "speclanes.lane": lane})

    def preset_faults(self, kinds: Iterable[str], lanes: Iterable[str]) -> None:
        """Every fault kind on every lane at 0 from the start: a series that first appears at 1
        hides that fault from `increase()` and `rate()`."""
        lanes = tuple(lanes)
        for kind in kinds:
            for lane in lanes:
                self.fault(kind, lane, 0)
