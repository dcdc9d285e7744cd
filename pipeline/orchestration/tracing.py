"""Each request's trace and the pipeline's metrics, as the orchestrator sees them.

The request's root span (GenAI conventions) parents every lane's spans through the W3C
context carried by each message. Its trace also shows the time queued for a verify lane,
every fault that concerned it and every lane restart it lived through.
"""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import MAX_TOKENS_LIMIT
from pipeline.decoding.speculation import Speculation
from pipeline.observability.metrics import LaneGauge, PipelineGauges, PipelineMetrics
from pipeline.observability.telemetry import Telemetry, carrier, fail
from pipeline.protocol.messages import LaneDown, StatusReport, Submit


class RequestTracing:
    def __init__(self, telemetry: Telemetry, metrics: PipelineMetrics, model_id: str) -> None:
        self.telemetry, self.metrics, self.model_id = telemetry, metrics, model_id
        self.roots: dict[str, Span] = {}
        self.queued: dict[str, Span] = {}
        self.restarts: dict[str, list[Span]] = {}  # per lane: spans of requests waiting out its restart

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
            "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.response.id": request_id,
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
        self.roots[request_id] = root
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

    def dequeued(self, request_id: str) -> None:
        if (span := self.queued.pop(request_id, None)) is not None:
            span.end()

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

    def first_token(self, seconds: float) -> None:
        self.metrics.first_token(seconds)

    def end(self, result: Result, seconds: float) -> None:
        self.dequeued(result.request_id)
        self.metrics.finished(len(result.tokens), seconds, result.finish_reason)
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
    lanes = {lane.name: LaneGauge(up=lane.state == "up", restarts=lane.restarts) for lane in report.lanes}
    reused = sum(lane.totals.prompt_tokens_reused for lane in report.lanes if lane.name == "verify")
    return PipelineGauges(
        running=report.active_requests, queued=report.queued_requests,
        audit_pending=report.audit_pending, lanes=lanes, prompt_tokens_reused=reused,
    )  # fmt: skip
