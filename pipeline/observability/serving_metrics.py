"""The serving figures operators of vLLM and llama.cpp read first, as the orchestrator sees them.

How requests ended (`speclanes.requests`, by outcome), how long they queued and prefilled, the time
per output token after the first (the GenAI conventions' `gen_ai.server.time_per_output_token`), and
how full the verify lane's KV cache is. Every outcome and finish reason is counted at 0 from the
start, so a `rate()` or `increase()` sees the first one (a series that appears at 1 loses it).

The KV-cache usage is what the orchestrator knows: the tokens each decoding request holds (its prompt
and the tokens journaled so far) over `context_length × admission.max_running`, the most the verify
lane holds when every running place is full. The verify lane runs a few steps ahead of the journal
and reserves rows ahead of use (session.capacity), so its own figure is somewhat higher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

Attributes = dict[str, str]

# Bucket edges in seconds: queue and prefill times as request times; one token takes milliseconds.
QUEUE_BUCKETS = (0.001, 0.005, *(0.01 * 2**i for i in range(13)))  # 10 ms to 41 s
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)


class CacheTally:
    """Tokens each decoding request holds in the verify lane's cache, and their sum: set per
    journaled step on the orchestrator's loop, read (two ints) from a metrics export thread."""

    def __init__(self) -> None:
        self.by_request: dict[str, int] = {}
        self.held = 0
        self.capacity = 0

    def hold(self, request_id: str, tokens: int) -> None:
        self.held += tokens - self.by_request.get(request_id, 0)
        self.by_request[request_id] = tokens

    def release(self, request_id: str) -> None:
        self.held -= self.by_request.pop(request_id, 0)


class ServingMetrics:
    def __init__(self, meter: Meter, base: Attributes, genai: Attributes) -> None:
        """`base`: the labels of every series (the model); `genai`: those the GenAI conventions
        require of their instruments (provider), to which each call adds the operation."""
        self.base, self.genai = base, genai
        self.requests = meter.create_counter(
            "speclanes.requests", "{request}",
            "Requests ended, by speclanes.outcome: finished (stop, length, step limit), aborted (cancelled "
            "by the client, its connection gone, the server shutting down or its disk full), error",
        )  # fmt: skip
        self.queue_time = meter.create_histogram(
            "speclanes.request.queue_time", "s",
            "Time from admission until the request's prompt went to the verify lane (a running place free "
            "and the lane up)", explicit_bucket_boundaries_advisory=QUEUE_BUCKETS,
        )  # fmt: skip
        self.prefill_time = meter.create_histogram(
            "speclanes.request.prefill_time", "s",
            "Time from the prompt going to the verify lane until the first token (the first token's "
            "time without the queue time)", explicit_bucket_boundaries_advisory=QUEUE_BUCKETS,
        )  # fmt: skip
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", "s",
            "Time per generated token after the first, per request that did not fail: (end - first "
            "token) / (output tokens - 1)", explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )  # fmt: skip
        self.cache = CacheTally()
        self._observed(meter)

    def _observed(self, meter: Meter) -> None:
        meter.create_observable_gauge(
            "speclanes.kv_cache.usage", [self._usage], "1",
            "Share of the verify lane's KV-cache capacity the decoding requests hold (0 to 1): "
            "speclanes.kv_cache.tokens over speclanes.kv_cache.capacity",
        )  # fmt: skip
        meter.create_observable_gauge(
            "speclanes.kv_cache.tokens", [self._one(lambda: self.cache.held)], "{token}",
            "Tokens the decoding requests hold: each one's prompt and its journaled output",
        )  # fmt: skip
        meter.create_observable_gauge(
            "speclanes.kv_cache.capacity", [self._one(lambda: self.cache.capacity)], "{token}",
            "The model's context length times admission.max_running: what the verify lane holds "
            "when every running place holds a full context",
        )  # fmt: skip

    def _one(self, read: Callable[[], int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
        return lambda options: [Observation(read(), self.base)]

    def _usage(self, options: CallbackOptions) -> Iterable[Observation]:
        held, capacity = self.cache.held, self.cache.capacity
        return [Observation(held / capacity if capacity else 0.0, self.base)]

    def preset(self, outcomes: Mapping[str, Iterable[str]]) -> None:
        """Every outcome and finish reason at 0, before any request ends."""
        for outcome, reasons in outcomes.items():
            for reason in reasons:
                self.requests.add(0, self._outcome(outcome, reason))

    def _outcome(self, outcome: str, reason: str) -> Attributes:
        return {**self.base, "speclanes.outcome": outcome, "gen_ai.response.finish_reasons": reason}

    def ended(self, outcome: str, reason: str) -> None:
        self.requests.add(1, self._outcome(outcome, reason))

    def dequeued(self, seconds: float) -> None:
        self.queue_time.record(seconds, self.base)

    def prefilled(self, seconds: float) -> None:
        self.prefill_time.record(seconds, self.base)

    def per_output_token(self, seconds: float, operation: str) -> None:
        self.time_per_output_token.record(seconds, {**self.genai, "gen_ai.operation.name": operation})
