"""A verify lane's target state for an Open, grammar included (structured output, issue 15).

Kept out of the `Verifier` so its class stays one job: what can go wrong here is the request's
own doing (a format this lane cannot compile, a re-prime whose output the grammar forbids), and
it costs that request a `bad_request`, never the lane.
"""

from __future__ import annotations

from pipeline.decoding.grammar.format import ResponseFormatError
from pipeline.decoding.grammar.matcher import GrammarViolation
from pipeline.decoding.target import TargetState
from pipeline.model import Runtime
from pipeline.protocol.messages import Open


def opened_target(model: Runtime, msg: Open, capacity: int) -> TargetState | str:
    """The request's state on this lane, or why there can be none.

    A new request's grammar starts at the beginning of the output. A re-prime (`sample=False`)
    rebuilds a lost state: its matcher must stand where the lost one stood, after the whole output,
    so it walks the output tokens in the prefix and then the pending token the Open names."""
    try:
        target = TargetState(
            model, msg.params, msg.seed, draws=msg.draws, capacity=capacity, prompt_length=msg.prompt_length,
            keep_features=msg.features,
        )  # fmt: skip
    except ResponseFormatError as exc:  # the orchestrator compiled it already: a client bypassing it
        return str(exc)
    if msg.sample or target.grammar is None:
        return target
    if msg.pending is None:
        return "a re-prime of a request with a response_format must name its pending token"
    start = len(msg.tokens) if msg.prompt_length is None else msg.prompt_length
    try:
        target.resume([*msg.tokens[start:], msg.pending])
    except GrammarViolation as exc:
        return f"the re-primed output does not follow its response_format: {exc}"
    return target
