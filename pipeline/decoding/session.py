"""One request's decoding state on the side that owns the accepted tokens.

It holds no model, so the same object drives the in-process loop (`speculative.decode`) and
the orchestrator's request machine; their outputs agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.adaptive import KController
from pipeline.decoding.output import OutputStream
from pipeline.decoding.result import Result, RunStats
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculation import Speculation
from pipeline.model.tokenizer import Tokenizer

INITIAL_OUTPUT_ROWS = 256


class PromptError(ValueError):
    """A prompt the model cannot take (empty, or filling the whole context)."""


def check_prompt(prompt_tokens: Sequence[int], context_length: int) -> None:
    if not prompt_tokens:
        raise PromptError("the prompt is empty")
    if len(prompt_tokens) >= context_length:
        raise PromptError(
            f"the prompt has {len(prompt_tokens)} tokens; the model's context is {context_length}, "
            "which leaves no room to generate"
        )


class Stats:
    """Per-request counters, summed up as `RunStats` at the end."""

    def __init__(self, k_max: int) -> None:
        self.steps = self.drafted = self.accepted = self.draft_failures = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.position_drafted = np.zeros(k_max, np.int64)
        self.position_accepted = np.zeros(k_max, np.int64)

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.position_drafted[:drafted] += 1
        self.position_accepted[:accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def summary(
        self, *, wall: float, prefill_seconds: float, tokens: int, seed: int, drafter: str
    ) -> RunStats:
        used = int(np.flatnonzero(self.position_drafted)[-1]) + 1 if self.drafted else 0
        return RunStats(
            steps=self.steps, drafted=self.drafted, accepted=self.accepted,
            acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=(
                self.position_accepted[:used] / np.maximum(self.position_drafted[:used], 1)
            ).tolist(),
            draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds,
            draft_failures=self.draft_failures, wall_seconds=wall, prefill_seconds=prefill_seconds,
            tokens_per_second=tokens / wall if wall > 0 else 0.0, seed=seed, drafter=drafter,
        )  # fmt: skip


class Session:
    """The k policy, the output stream and the counters of one request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_length: int,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        speculation: Speculation,
    ) -> None:
        fixed = speculation.fixed_k
        self.controller = KController(fixed=fixed, k_max=max(speculation.k_max, fixed or 1))
        self.stats = Stats(self.controller.k_max)
        self.out = OutputStream(tokenizer, params)
        self.params, self.context_length = params, context_length
        self.max_iterations = speculation.max_iterations
        self.prompt_tokens = list(prompt_tokens)
        self.context = list(prompt_tokens)
        self._ending: str | None = None

    def capacity(self) -> int:
        """KV-cache rows the verifier reserves up front. At most INITIAL_OUTPUT_ROWS of output:
        the cache doubles as the request grows, so a huge max_tokens reserves nothing it has not used."""
        output = min(self.params.max_tokens, INITIAL_OUTPUT_ROWS)
        return min(self.context_length, len(self.prompt_tokens) + output + self.controller.k_max + 1)

    def start(self, first: int) -> str:
        """The token sampled from the prefill; returns the text it releases."""
        self.context.append(first)
        return self.out.push(first)

    def plan(self) -> int | None:
        """How many drafts the next step may verify, or None once the request is over."""
        if self.out.done:
            return None
        if self.max_iterations is not None and self.stats.steps >= self.max_iterations:
            self._ending = "max_iterations_exceeded"
            return None
        room = self.context_length - len(self.context)  # positions left once the pending token is fed
        if room < 0:
            self._ending = "length"
            return None
        return max(0, min(self.controller.choose(), room, self.params.max_tokens - len(self.out.tokens) - 1))

    def finish_text(self) -> str:
        """When `plan` ended the request itself: mark the output finished, flush held-back text."""
        return self.out.finish(self._ending) if self._ending and not self.out.done else ""

    def record(
        self, drafted: int, emitted: Sequence[int], accepted: int, draft_s: float, verify_s: float
    ) -> str:
        """Book one verify pass and push its tokens; returns the text they release."""
        stats, controller = self.stats, self.controller
        stats.record(drafted, accepted)
        stats.verify_seconds += verify_s
        stats.draft_seconds += draft_s
        controller.costs.observe_verify(drafted + 1, verify_s)
        controller.costs.observe_draft(drafted, draft_s)
        controller.observe(drafted, accepted)
        text = []
        for token in emitted:
            text.append(self.out.push(token))
            if self.out.done:
                break
        self.context.extend(emitted)
        return "".join(text)

    def result(
        self, *, wall: float, prefill_seconds: float, seed: int, drafter: str, request_id: str = "",
        finish_reason: str | None = None,
    ) -> Result:  # fmt: skip
        out = self.out
        stats = self.stats.summary(
            wall=wall, prefill_seconds=prefill_seconds, tokens=len(out.tokens), seed=seed, drafter=drafter
        )
        return Result(
            request_id=request_id, prompt_tokens=self.prompt_tokens, tokens=out.tokens, text=out.text,
            finish_reason=finish_reason or out.finish_reason or "length", stats=stats,
        )  # fmt: skip
