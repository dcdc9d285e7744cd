"""A lane's per-step telemetry: one span per run of a request's steps, each step's figures in columns.

A span per step made a long answer thousands of spans (a 2,000-token plain answer: 2,000 "verify"
spans, and as many "draft" spans again). Each lane's span for a request ("verify" in the verify lane,
"draft" in the draft lane) covers up to STEPS_PER_SPAN steps; it ends when full, and when the request
leaves the lane (finished, closed, re-primed, lost, evicted), with the run's totals, so a trace still
shows every step each lane handled.

Each step's figures go into columns, one value a step, set on the span as array attributes when it
ends (`speclanes.step.number`, `speclanes.step.start_us` from the span's start, and the lane's own:
`speclanes.step.k` ...). An event a step cost the verify lane more than twice the CPU, its attributes
checked as it was made and encoded to JSON on export, and the 8-client forwards felt it
(docs/benchmarks.md, "What the per-step record keeping costs").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.messages import Verified, Verify

STEPS_PER_SPAN = 32
Value = int | str
PREFIX = "speclanes.step."
# The verify lane's columns, each with its default; a step always gives all of them.
VERIFY_COLUMNS: dict[str, Value] = {"k": 0, "accepted": 0, "batch_size": 0, "batch_rows": 0, "emitted": 0}
# The draft lane's: k asked, tokens drafted, the drafter that made them, or the fault's kind.
DRAFT_COLUMNS: dict[str, Value] = {"k": 0, "drafted": 0, "drafter": "", "failed": ""}


@dataclass
class Run:
    span: Span
    start_ns: int
    columns: dict[str, list[Value]]  # its steps' figures; "number" holds their step numbers
    totals: dict[str, int] = field(default_factory=dict)


class RunSpans:
    """The open run span of each request this lane is serving, under span name `name`. `columns`: the
    figures a step records, each with the value of a step that does not give it (an array attribute
    holds one type)."""

    def __init__(self, telemetry: Telemetry, name: str, columns: Mapping[str, Value]) -> None:
        self.telemetry, self.name = telemetry, name
        self.defaults = {"number": 0, "start_us": 0, **columns}
        self.open: dict[str, Run] = {}

    def record(
        self, request_id: str, trace: Mapping[str, str], step: int, values: Mapping[str, Value],
        totals: Mapping[str, int], start_ns: int | None = None,
    ) -> None:  # fmt: skip
        """A step into the request's open span's columns (a new span if none is open); `totals` are
        summed over the run onto the span as it ends (`speclanes.<name>`)."""
        start_ns = time.time_ns() if start_ns is None else start_ns
        run = self.open.get(request_id)
        if run is None:
            first = {"speclanes.request_id": request_id, "speclanes.first_step": step}
            span = self.telemetry.start(self.name, trace, first, start_time=start_ns)
            run = self.open[request_id] = Run(span, start_ns, {k: [] for k in self.defaults})
        values = {**values, "number": step, "start_us": (start_ns - run.start_ns) // 1000}
        for key, column in run.columns.items():
            column.append(values.get(key, self.defaults[key]))
        for key, value in totals.items():
            run.totals[key] = run.totals.get(key, 0) + value
        if len(run.columns["number"]) >= STEPS_PER_SPAN:
            self.end(request_id)

    def end(self, request_id: str) -> None:
        """The request's open span, if any, ends now with its totals and its steps' columns."""
        run = self.open.pop(request_id, None)
        if run is None:
            return
        totals = {f"speclanes.{key}": value for key, value in run.totals.items()}
        numbers = run.columns["number"]
        columns = {PREFIX + key: column for key, column in run.columns.items()}
        run.span.set_attributes(
            {"speclanes.last_step": numbers[-1], "speclanes.steps": len(numbers), **totals, **columns}
        )
        run.span.end()


class StepSpans(RunSpans):
    """The verify lane's: each step's k, accepted, batch size and rows, tokens emitted, at the
    forward's start."""

    def __init__(self, telemetry: Telemetry) -> None:
        super().__init__(telemetry, "verify", VERIFY_COLUMNS)

    def step(self, msg: Verify, reply: Verified, start_ns: int, rows: int) -> None:
        k, accepted = len(msg.drafts), reply.accepted
        values = {
            "k": k, "accepted": accepted, "batch_size": reply.batch_size, "batch_rows": rows,
            "emitted": len(reply.tokens),
        }  # fmt: skip
        totals = {"drafted": k, "accepted": accepted}
        self.record(msg.request_id, msg.trace, msg.step, values, totals, start_ns)
