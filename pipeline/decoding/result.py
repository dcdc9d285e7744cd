"""A request's final result: the same typed struct from the in-process loop, the pipeline's
client protocol, the CLI's `--json`, the HTTP API and the benchmarks."""

from __future__ import annotations

import msgspec

from pipeline.decoding.logprobs import TokenLogprobs

FINISH_REASONS = ("stop", "length", "max_iterations_exceeded", "cancelled", "error")


class RunStats(msgspec.Struct, kw_only=True):
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0  # tokens emitted per verify step
    per_position_acceptance: list[float] = []
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_failures: int = 0
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    tokens_per_second: float = 0.0
    seed: int = 0
    drafter: str = ""
    nodes_per_step: float = 0.0  # draft nodes verified per step (a chain's tokens, a tree's nodes)


class RequestError(msgspec.Struct, frozen=True):
    kind: str
    message: str


class Result(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`error` is set exactly when `finish_reason` is "error"; then tokens and stats may be empty.
    `logprobs`: one entry per token of `tokens` when the request asked for them (None: it did not)."""

    finish_reason: str
    request_id: str = ""
    prompt_tokens: list[int] = []
    tokens: list[int] = []
    text: str = ""
    stats: RunStats = msgspec.field(default_factory=RunStats)
    error: RequestError | None = None
    logprobs: list[TokenLogprobs] | None = None

    @classmethod
    def failed(cls, request_id: str, kind: str, message: str) -> Result:
        return cls(finish_reason="error", request_id=request_id, error=RequestError(kind, message))
