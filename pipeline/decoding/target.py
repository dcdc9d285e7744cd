"""One request's state on the side that holds the target model: its KV cache, its seed (every
number it uses is keyed by the seed and the position it decides: `noise`) and the tokens its
cache holds, which the context-reading controls (`controls`) condition on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict, verify
from pipeline.decoding.controls import chain_paths, shaped_probs, uses_context
from pipeline.decoding.sampling import SamplingParams, sample_at, target_probs
from pipeline.model import Runtime


class TargetState:
    """`draws` counts the numbers used so far (for the audit trail); nothing depends on it, so a
    re-primed verifier starts wherever the accepted prefix ends.

    `context` mirrors the KV cache: the prompt, then the output except its newest (pending) token,
    which each step feeds. `prompt_length` says where the prompt ends in it; None: everything
    prefilled before the first token is prompt (a re-prime names it, as its prefix holds output)."""

    def __init__(
        self, model: Runtime, params: SamplingParams, seed: int, *, draws: int = 0, capacity: int,
        prompt_length: int | None = None,
    ) -> None:  # fmt: skip
        self.model, self.params, self.seed, self.draws = model, params, seed, draws
        self.cache = model.new_cache(capacity=capacity)
        self.context: list[int] = []
        self.prompt_length = prompt_length

    def prefill(self, tokens: Sequence[int], *, sample: bool = True) -> tuple[int | None, float | None]:
        """Feed `tokens`; sample the next token from the last position if asked."""
        logits = self.model.forward(self.cache, tokens, all_logits=False)
        self.prefilled(tokens)
        return self.first_token(logits[0]) if sample else (None, None)

    def prefilled(self, tokens: Sequence[int]) -> None:
        """The cache now holds `tokens` (a caller that feeds a prompt in chunks says so once it is in)."""
        self.context = list(tokens)
        if self.prompt_length is None:
            self.prompt_length = len(self.context)

    def first_token(self, last_logits: np.ndarray) -> tuple[int, float | None]:
        """The token after the prompt, from the prompt's last logits row (fed whole or in chunks)."""
        probs = self.distributions(last_logits[None], [], [[]])[0]
        token, u = sample_at(probs, self.seed, self.cache.length)
        self.draws += u is not None
        return token, u

    def distributions(
        self, logits: np.ndarray, fed: Sequence[int], paths: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """The target rows q for `logits`, where row i follows the cached context, then `fed` (the
        tokens this forward fed before its first row: the pending token), then `paths[i]`."""
        if not uses_context(self.params):
            return target_probs(logits, self.params)
        prompt_length = len(self.context) if self.prompt_length is None else self.prompt_length
        return shaped_probs(logits, self.params, [*self.context, *fed], prompt_length, paths)

    def conclude(
        self, logits: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None, *, pending: int
    ) -> Verdict:
        """Apply the acceptance rule to a forward over [pending, *drafts] and roll back."""
        start = self.cache.length - len(drafts)  # the position row 0 decides: right after `pending`
        q = self.distributions(logits, [pending], chain_paths(drafts))
        verdict = verify(drafts, draft_probs, q, self.seed, start)
        self.cache.truncate(start + verdict.accepted)
        self.context += [pending, *drafts[: verdict.accepted]]
        # A rejected deterministic draft's number also chose its replacement: count it once.
        self.draws += len({*(d.u for d in verdict.decisions), verdict.final_u} - {None})
        return verdict
