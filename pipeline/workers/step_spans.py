"""The verify lane's per-step telemetry: one span per run of a request's steps, an event per step.

A span per step made a long answer thousands of spans (a 2,000-token plain answer: 2,000 "verify"
spans). Each request's "verify" span now covers up to STEPS_PER_SPAN steps, with one "step" event
each (its number, k, accepted, batch size and rows, tokens emitted, at the forward's start); it ends
when full, and when the request leaves the lane (finished, closed, re-primed, lost), so a trace still
shows every step the lane decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Span

from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.messages import Verified, Verify

STEPS_PER_SPAN = 32


@dataclass
class Burst:
    span: Span
    first: int
    last: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


class StepSpans:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.open: dict[str, Burst] = {}

    def step(self, msg: Verify, reply: Verified, start_ns: int, rows: int) -> None:
        """A decided step: an event on the request's open span (a new span if none is open)."""
        burst = self.open.get(msg.request_id)
        if burst is None:
            attributes = {"speclanes.request_id": msg.request_id, "speclanes.first_step": msg.step}
            span = self.telemetry.start("verify", msg.trace, attributes, start_time=start_ns)
            burst = self.open[msg.request_id] = Burst(span, msg.step)
        k, accepted = len(msg.drafts), reply.accepted
        burst.span.add_event(
            "step",
            {
                "speclanes.step": msg.step, "speclanes.k": k, "speclanes.accepted": accepted,
                "speclanes.acceptance": accepted / k if k else 0.0, "speclanes.batch_size": reply.batch_size,
                "speclanes.batch_rows": rows, "speclanes.emitted": len(reply.tokens),
            },
            timestamp=start_ns,
        )  # fmt: skip
        burst.last, burst.steps = msg.step, burst.steps + 1
        burst.drafted, burst.accepted = burst.drafted + k, burst.accepted + accepted
        if burst.steps >= STEPS_PER_SPAN:
            self.end(msg.request_id)

    def end(self, request_id: str) -> None:
        """The request's open span, if any, ends now with its totals."""
        burst = self.open.pop(request_id, None)
        if burst is None:
            return
        burst.span.set_attributes(
            {
                "speclanes.last_step": burst.last, "speclanes.steps": burst.steps,
                "speclanes.drafted": burst.drafted, "speclanes.accepted": burst.accepted,
            }
        )  # fmt: skip
        burst.span.end()
