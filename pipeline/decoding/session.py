"""One request's decoding state on the side that owns the accepted tokens.

It holds no model, so the same object drives the in-process loop (`speculative.decode`) and
the orchestrator's request machine; their outputs agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict
from pipeline.decoding.adaptive import Controller
from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.drafters.kinds import paid_per_draft
from pipeline.decoding.logprobs import TokenLogprobs
from pipeline.decoding.output import OutputStream
from pipeline.decoding.result import Result, RunStats
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculation import Speculation
from pipeline.decoding.tree import chain, select, step_shape
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
    """Per-request counters, summed up as `RunStats` at the end. `drafted` counts draft nodes
    verified (a chain's tokens, a tree's nodes); per-position counts are per depth: how many
    steps offered a node at depth d, and how many kept one."""

    def __init__(self, k_max: int) -> None:
        self.steps = self.drafted = self.accepted = self.draft_failures = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.position_drafted = np.zeros(k_max, np.int64)
        self.position_accepted = np.zeros(k_max, np.int64)

    def record(self, drafted: int, accepted: int, depth: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.position_drafted[:depth] += 1
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
            nodes_per_step=self.drafted / self.steps if self.steps else 0.0,
        )  # fmt: skip


class Session:
    """The k policy, the output stream and the counters of one request. `logprobs` holds the
    served tokens' entries (`decoding.logprobs`), one per token of `out.tokens` when asked for:
    entries of tokens past a stop or max_tokens are dropped with the tokens."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_length: int,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        speculation: Speculation,
    ) -> None:
        fixed = speculation.fixed_k
        self.controller = Controller(fixed=fixed, k_max=max(speculation.k_max, fixed or 1))
        self.stats = Stats(self.controller.k_max)
        self.tree, self.drafter = speculation.tree, speculation.drafter
        self.out = OutputStream(tokenizer, params)
        self.params, self.context_length = params, context_length
        self.max_iterations = speculation.max_iterations
        self.prompt_tokens = list(prompt_tokens)
        self.context = list(prompt_tokens)
        self.logprobs: list[TokenLogprobs] = []
        self._ending: str | None = None

    def capacity(self) -> int:
        """KV-cache rows the verifier reserves up front. At most INITIAL_OUTPUT_ROWS of output:
        the cache doubles as the request grows, so a huge max_tokens reserves nothing it has not used."""
        output = min(self.params.max_tokens, INITIAL_OUTPUT_ROWS)
        return min(self.context_length, len(self.prompt_tokens) + output + self.controller.k_max + 1)

    def start(self, first: int, logprobs: Sequence[TokenLogprobs] = ()) -> str:
        """The token sampled from the prefill (and its entry); returns the text it releases."""
        self.context.append(first)
        self.logprobs.extend(logprobs[:1])
        return self.out.push(first)

    def plan(self, neighbours: int = 0) -> int | None:
        """How many draft nodes to ask the drafter for, or None once the request is over. With
        `neighbours` (other requests sharing the verify forward) it is no more than their forward has
        room for: where that is none, the step goes plain without a trip to the drafter, whose
        proposal the cut would drop."""
        if self.out.done:
            return None
        if self.max_iterations is not None and self.stats.steps >= self.max_iterations:
            self._ending = "max_iterations_exceeded"
            return None
        room = self.context_length - len(self.context)  # positions left once the pending token is fed
        if room < 0:
            self._ending = "length"
            return None
        budget = self.controller.room(neighbours, self.controller.budget(self.drafter))
        return max(0, min(budget, room, self.params.max_tokens - len(self.out.tokens) - 1))

    def floor(self) -> float:
        """What a tree's likeliest first node must weigh for the drafter to build the tree
        (`Controller.floor`; trees carry the request's drafter's name)."""
        return self.controller.floor(self.drafter) if self.tree else 0.0

    def cut(self, proposal: Proposal, want: int, neighbours: int = 0) -> Proposal:
        """What of a proposal the next step verifies: at most `want` nodes, as the controller
        chooses (`neighbours`: other requests sharing the verify forward). A proposal that is
        not the shape it claims is dropped: it would only cost speed."""
        tokens = proposal.tokens[:want] if proposal.parents is None else proposal.tokens
        parents = chain(len(tokens)) if proposal.parents is None else proposal.parents
        if proposal.probs is not None and (proposal.parents is not None or len(proposal.probs) < len(tokens)):
            return EMPTY  # sampled drafts come as a chain, with a row per token
        shares = proposal.shares or [1.0] * len(parents)
        if len(parents) != len(tokens) or len(shares) != len(tokens):
            return EMPTY
        keep = [i for i in self.controller.cut(parents, shares, neighbours, proposal.drafter) if i < want]
        kept = select(parents, keep)
        return Proposal(
            [tokens[i] for i in keep], None if proposal.probs is None else proposal.probs[: len(keep)],
            proposal.drafter, None if kept == chain(len(kept)) else kept, [shares[i] for i in keep],
        )  # fmt: skip

    def finish_text(self) -> str:
        """When `plan` ended the request itself: mark the output finished, flush held-back text."""
        return self.out.finish(self._ending) if self._ending and not self.out.done else ""

    def record_draft(
        self, draft: Proposal, verdict: Verdict, draft_s: float, verify_s: float,
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> str:  # fmt: skip
        """`record` for a verified `draft` (a chain or a tree) and its verdict."""
        depth, offered = step_shape(draft.parents, draft.shares, len(draft.tokens), verdict.path)
        return self.record(
            len(draft.tokens), verdict.tokens, verdict.accepted, draft_s, verify_s, depth=depth,
            offered=offered, paid_drafts=len(draft.tokens) if paid_per_draft(draft.drafter) else 0,
            drafter=draft.drafter, logprobs=logprobs,
        )  # fmt: skip

    def record(
        self, drafted: int, emitted: Sequence[int], accepted: int, draft_s: float, verify_s: float,
        *, depth: int | None = None, offered: Sequence[float] | None = None, paid_drafts: int = 0,
        drafter: str = "", logprobs: Sequence[TokenLogprobs] = (),
    ) -> str:  # fmt: skip
        """Book one verify pass of `drafted` nodes (`depth` levels; a chain if not given) and push
        its tokens; returns the text they release. `offered`: `tree.offered` of the step;
        `logprobs`: the emitted tokens' entries, kept for the tokens served."""
        stats, controller = self.stats, self.controller
        if depth is None or offered is None:  # a chain, shares 1
            depth, offered = step_shape(None, None, drafted, range(accepted))
        stats.record(drafted, accepted, depth)
        stats.verify_seconds += verify_s
        stats.draft_seconds += draft_s
        if drafted or controller.fixed is None:
            seconds = (verify_s, draft_s + verify_s)
            controller.observe(drafted + 1, *seconds, offered, accepted, paid_drafts, drafter)
        text = []
        for i, token in enumerate(emitted):
            text.append(self.out.push(token))
            self.logprobs.extend(logprobs[i : i + 1])
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
            logprobs=None if self.params.logprobs is None else self.logprobs,
        )  # fmt: skip
