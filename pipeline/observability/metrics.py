"""The orchestrator's metrics, through the OpenTelemetry metrics SDK.

The orchestrator sees every step of every request, so the speculation figures are
counted there once, whatever lane did the work: drafted and accepted tokens, acceptance
by draft position, accepted length per step (its mean is the figure vLLM reports),
step latency by lane as the request experiences it, time to first token, tokens/s and
active requests. Names follow the GenAI semantic conventions where one exists.
"""

from __future__ import annotations

from opentelemetry.metrics import Meter

# Bucket edges in seconds for step latencies (tens of ms per forward) and request times.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


class PipelineMetrics:
    def __init__(self, meter: Meter, model: str) -> None:
        self.base = {"gen_ai.request.model": model}
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
            "Round trip of one draft or verify call as the request sees it, by lane",
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
        self.active = meter.create_up_down_counter(
            "speclanes.requests.active", "{request}", "Requests admitted and not yet finished"
        )
        self.faults = meter.create_counter("speclanes.faults", "{fault}", "Faults by kind and lane")
        self.lane_attributes = {lane: {**self.base, "speclanes.lane": lane} for lane in ("draft", "verify")}

    def admitted(self, prompt_tokens: int) -> None:
        self.active.add(1, self.base)
        self.token_usage.add(prompt_tokens, {**self.base, "gen_ai.token.type": "input"})

    def first_token(self, seconds: float) -> None:
        self.ttft.record(seconds, self.base)

    def step(
        self, drafter: str, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """Six instrument calls: a step is on the request's critical path (each costs ~10 µs)."""
        attrs = {**self.base, "speclanes.drafter": drafter or "none"}
        self.drafted.add(drafted, attrs)
        self.accepted.add(accepted, attrs)
        if drafted:
            self.accepted_drafts.record(accepted, {**attrs, "speclanes.drafted": drafted})
        self.accepted_length.record(accepted + 1, attrs)
        if draft_seconds:
            self.step_duration.record(draft_seconds, self.lane_attributes["draft"])
        self.step_duration.record(verify_seconds, self.lane_attributes["verify"])

    def finished(self, output_tokens: int, seconds: float, finish_reason: str) -> None:
        attrs = {**self.base, "gen_ai.response.finish_reasons": finish_reason}
        self.active.add(-1, self.base)
        self.token_usage.add(output_tokens, {**self.base, "gen_ai.token.type": "output"})
        self.request_duration.record(seconds, attrs)
        if seconds > 0:
            self.tokens_per_second.record(output_tokens / seconds, attrs)

    def fault(self, kind: str, lane: str) -> None:
        self.faults.add(1, {"speclanes.fault.kind": kind, "speclanes.lane": lane})
