"""A lane's per-step telemetry: one span per run of a request's steps, an event per step.

A span per step made a long answer thousands of spans (a 2,000-token plain answer: 2,000 "verify"
spans, and as many "draft" spans again). Each lane's span for a request ("verify" in the verify lane,
"draft" in the draft lane) covers up to STEPS_PER_SPAN steps, with one "step" event each; it ends
when full, and when the request leaves the lane (finished, closed, re-primed, lost, evicted), with
the run's totals, so a trace still shows every step each lane handled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.messages import Verified, Verify

STEPS_PER_SPAN = 32


@dataclass
class Run:
    span: Span
    first: int
    last: int = 0
    steps: int = 0
    totals: dict[str, int] = field(default_factory=dict)


class RunSpans:
    """The open run span of each request this lane is serving, under span name `name`."""

    def __init__(self, telemetry: Telemetry, name: str) -> None:
        self.telemetry, self.name = telemetry, name
        self.open: dict[str, Run] = {}

    def record(
        self, request_id: str, trace: Mapping[str, str], step: int, attributes: Mapping[str, Any],
        totals: Mapping[str, int], start_ns: int | None = None,
    ) -> None:  # fmt: skip
        """A step: an event on the request's open span (a new span if none is open); `totals` are
        summed over the run onto the span as it ends (`speclanes.<name>`)."""
        run = self.open.get(request_id)
        if run is None:
            first = {"speclanes.request_id": request_id, "speclanes.first_step": step}
            run = self.open[request_id] = Run(
                self.telemetry.start(self.name, trace, first, start_time=start_ns), step
            )
        run.span.add_event("step", {"speclanes.step": step, **attributes}, timestamp=start_ns)
        run.last, run.steps = step, run.steps + 1
        for key, value in totals.items():
            run.totals[key] = run.totals.get(key, 0) + value
        if run.steps >= STEPS_PER_SPAN:
            self.end(request_id)

    def end(self, request_id: str) -> None:
        """The request's open span, if any, ends now with its totals."""
        run = self.open.pop(request_id, None)
        if run is None:
            return
        totals = {f"speclanes.{key}": value for key, value in run.totals.items()}
        run.span.set_attributes({"speclanes.last_step": run.last, "speclanes.steps": run.steps, **totals})
        run.span.end()


class StepSpans(RunSpans):
    """The verify lane's: each step's k, accepted, batch size and rows, tokens emitted, at the
    forward's start."""

    def __init__(self, telemetry: Telemetry) -> None:
        super().__init__(telemetry, "verify")

    def step(self, msg: Verify, reply: Verified, start_ns: int, rows: int) -> None:
        k, accepted = len(msg.drafts), reply.accepted
        attributes = {
            "speclanes.k": k, "speclanes.accepted": accepted,
            "speclanes.acceptance": accepted / k if k else 0.0,
            "speclanes.batch_size": reply.batch_size, "speclanes.batch_rows": rows,
            "speclanes.emitted": len(reply.tokens),
        }  # fmt: skip
        self.record(
            msg.request_id, msg.trace, msg.step, attributes, {"drafted": k, "accepted": accepted}, start_ns
        )
