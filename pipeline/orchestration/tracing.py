"""Each request's trace and the pipeline's metrics, as the orchestrator sees them.

The request's root span (GenAI conventions) parents every lane's spans through the W3C
context carried by each message. Its trace also shows the time queued for a verify lane,
every fault that concerned it and every lane restart it lived through. The metrics count how
each request ended (`OUTCOMES`), its queue, prefill and per-token times, and the tokens it holds
in the verify lane's cache (observability/serving_metrics.py).
"""

from __future__ import annotations

from typing import get_args

from opentelemetry.trace import Span, SpanKind

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import MAX_TOKENS_LIMIT
from pipeline.decoding.speculation import Speculation
from pipeline.observability.metrics import LaneGauge, PipelineGauges, PipelineMetrics
from pipeline.observability.request_ids import CHOICE_ID
from pipeline.observability.telemetry import RESPONSE_PREFIX, Telemetry, baggage_of, carrier, fail
from pipeline.orchestration.lane_table import LANES
from pipeline.protocol.messages import FaultKind, LaneDown, StatusReport, Submit

# How a request ended, by its finish reason: on its own (finished), ended early by its client, its
# connection's end, the server's shutdown or a full disk (aborted), or failed (error).
OUTCOMES = {
    "finished": ("stop", "length", "max_iterations_exceeded"),
    "aborted": ("cancelled", "server_shutdown", "storage_full"),
    "error": ("error",),
}
FAULT_LANES = (*LANES, "gateway")  # the processes a fault can name
RESUMED_OPERATION = "generate_content"  # a resumed request's Submit (chat or not) is not journaled


def response_id(request_id: str, msg: Submit) -> str:
    """The id its client receives: the gateway's (`chatcmpl-<base>` for every choice `<base>-<i>` of
    a request with n > 1, the prefix from the gateway's baggage), else the request id itself."""
    if (prefix := baggage_of(msg.trace, RESPONSE_PREFIX)) is None:
        return request_id
    return prefix + (request_id.rpartition("-")[0] if CHOICE_ID.fullmatch(request_id) else request_id)


def outcome(result: Result) -> str:
    if result.error is not None:
        return "error"
    return "aborted" if result.finish_reason in OUTCOMES["aborted"] else "finished"


class RequestTracing:
    def __init__(self, telemetry: Telemetry, metrics: PipelineMetrics, model_id: str) -> None:
        self.telemetry, self.metrics, self.model_id = telemetry, metrics, model_id
        self.roots: dict[str, Span] = {}
        self.queued: dict[str, Span] = {}
        self.restarts: dict[str, list[Span]] = {}  # per lane: spans of requests waiting out its restart
        self.operations: dict[str, str] = {}  # per request: chat or text_completion (GenAI conventions)
        self.waited: dict[str, float] = {}  # per request: seconds from admission to its prompt's going
        metrics.preset_faults(get_args(FaultKind), FAULT_LANES)
        metrics.serving.preset(OUTCOMES)

    def cache_capacity(self, tokens: int) -> None:
        """What the KV-cache usage gauge divides by: the context length times the running places."""
        self.metrics.serving.cache.capacity = tokens

    def holds(self, request_id: str, tokens: int) -> None:
        """The request's tokens (prompt and journaled output) the verify lane holds now."""
        self.metrics.serving.cache.hold(request_id, tokens)

    def start(
        self, request_id: str, msg: Submit, seed: int, prompt_tokens: int, speculation: Speculation
    ) -> dict[str, str]:
        """Open the root span (under the caller's, if it sent one); returns its W3C context."""
        params, operation = msg.params, "chat" if msg.chat or msg.messages is not None else "text_completion"
        attributes = {
            "gen_ai.operation.name": operation, "gen_ai.provider.name": "speclanes",
            "gen_ai.request.model": self.model_id,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k, "gen_ai.request.seed": seed,
            "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.response.id": response_id(request_id, msg),
            "speclanes.request_id": request_id, "speclanes.drafter": speculation.drafter,
            "speclanes.k": "auto" if speculation.fixed_k is None else str(speculation.fixed_k),
        }  # fmt: skip
        if params.max_tokens < MAX_TOKENS_LIMIT:  # the limit (an API request naming none has none)
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        if params.presence_penalty or params.frequency_penalty:  # the GenAI conventions name these two
            attributes["gen_ai.request.presence_penalty"] = params.presence_penalty
            attributes["gen_ai.request.frequency_penalty"] = params.frequency_penalty
        root = self.telemetry.start(
            f"{operation} {self.model_id}", msg.trace, attributes, kind=SpanKind.SERVER
        )
        self.roots[request_id], self.operations[request_id] = root, operation
        self.queued[request_id] = self.telemetry.start(
            "queue", root
        )  # until its prompt goes to a verify lane
        self.metrics.admitted(prompt_tokens)
        return carrier(root)

    def resumed(self, request_id: str, trace: dict[str, str], steps: int) -> None:
        """A request a restarted orchestrator carries on: a new root span in the request's own
        trace (the first root died with the old process), ended like any other."""
        attributes = {"speclanes.request_id": request_id, "speclanes.resumed_after_step": steps - 1}
        self.roots[request_id] = self.telemetry.start(
            f"resumed {self.model_id}", trace, attributes, kind=SpanKind.SERVER
        )

    def dequeued(self, request_id: str, waited: float | None = None) -> None:
        """Its prompt went to the verify lane `waited` seconds after admission (None: it ended
        while queued, or was never queued here)."""
        if (span := self.queued.pop(request_id, None)) is not None:
            span.end()
            if waited is not None:
                self.waited[request_id] = waited
                self.metrics.serving.dequeued(waited)

    def fault(
        self, kind: str, lane: str, message: str, request_ids: list[str], step: int | None = None
    ) -> None:
        """Into the trace of every request it concerns, or a trace of its own if none (the Ledger,
        which keeps every fault, counts it: `count_fault`)."""
        for request_id in request_ids:
            self.telemetry.fault(
                self.roots.get(request_id), kind, lane, message, request_id=request_id, step=step
            )
        if not request_ids:
            self.telemetry.fault(None, kind, lane, message)

    def count_fault(self, kind: str, lane: str) -> None:
        """Into the faults metric: every fault the orchestrator keeps, whether it saw it itself or a
        lane reported it (that lane traced it)."""
        self.metrics.fault(kind, lane)

    def lane_down(self, msg: LaneDown, running: list[str]) -> None:
        attributes = {
            "speclanes.lane": msg.lane, "speclanes.lane.pid": msg.pid, "speclanes.lane.restarts": msg.restarts
        }  # fmt: skip
        waiting = self.restarts.setdefault(msg.lane, [])
        for request_id in running:
            waiting.append(
                self.telemetry.start(f"lane restart {msg.lane}", self.roots.get(request_id), attributes)
            )

    def lane_back(self, lane: str, pid: int | None) -> None:
        for span in self.restarts.pop(lane, []):
            span.set_attribute("speclanes.lane.new_pid", pid or 0)
            span.end()

    def step(
        self, drafter: str, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        self.metrics.step(drafter, drafted, accepted, draft_seconds, verify_seconds)

    def first_token(self, seconds: float, request_id: str) -> None:
        """`seconds` from admission; less the queue time, the prefill's."""
        self.metrics.first_token(seconds, self.operations.get(request_id, RESUMED_OPERATION))
        if (waited := self.waited.pop(request_id, None)) is not None:
            self.metrics.serving.prefilled(max(seconds - waited, 0.0))

    def end(self, result: Result, seconds: float) -> None:
        request_id, tokens, serving = result.request_id, len(result.tokens), self.metrics.serving
        self.dequeued(request_id)
        self.waited.pop(request_id, None)
        serving.cache.release(request_id)
        operation = self.operations.pop(request_id, RESUMED_OPERATION)
        self.metrics.finished(tokens, seconds, result.finish_reason, operation)
        serving.ended(outcome(result), result.finish_reason)
        first = result.stats.prefill_seconds  # from admission to the first token
        if result.error is None and tokens > 1 and 0 < first <= seconds:
            serving.per_output_token((seconds - first) / (tokens - 1), operation)
        root = self.roots.pop(result.request_id, None)
        if root is None:
            return
        stats = result.stats
        root.set_attributes(
            {
                "gen_ai.usage.output_tokens": len(result.tokens),
                "gen_ai.response.finish_reasons": [result.finish_reason],
                "speclanes.steps": stats.steps, "speclanes.drafted": stats.drafted,
                "speclanes.accepted": stats.accepted, "speclanes.acceptance": stats.acceptance_rate,
                "speclanes.mean_accepted_length": stats.mean_accepted_length,
            }
        )  # fmt: skip
        if result.error is not None:
            fail(root, f"{result.error.kind}: {result.error.message}")
        root.end()


def gauges_of(report: StatusReport) -> PipelineGauges:
    """What the state-like metrics read at each collection: the numbers `status` shows."""
    lanes = {
        lane.name: LaneGauge(lane.state == "up", lane.restarts, pid=lane.pid, process=lane.process)
        for lane in report.lanes
    }
    verify = report.lane("verify")
    return PipelineGauges(
        running=report.active_requests, queued=report.queued_requests,
        audit_pending=report.audit_pending, lanes=lanes,
        prompt_tokens_reused=verify.totals.prompt_tokens_reused if verify else 0,
        verify_loop_seconds=dict(verify.totals.loop_seconds) if verify else {},
    )  # fmt: skip
