"""One request's state on the side that holds the target model: its KV cache and its seed
(every number it uses is keyed by the seed and the position it decides: `noise`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict, verify, verify_tree
from pipeline.decoding.sampling import SamplingParams, sample_at, target_probs
from pipeline.model import Runtime


class TargetState:
    """`draws` counts the numbers used so far (for the audit trail); nothing depends on it, so a
    re-primed verifier starts wherever the accepted prefix ends."""

    def __init__(
        self, model: Runtime, params: SamplingParams, seed: int, *, draws: int = 0, capacity: int
    ) -> None:
        self.model, self.params, self.seed, self.draws = model, params, seed, draws
        self.cache = model.new_cache(capacity=capacity)

    def prefill(self, tokens: Sequence[int], *, sample: bool = True) -> tuple[int | None, float | None]:
        """Feed `tokens`; sample the next token from the last position if asked."""
        logits = self.model.forward(self.cache, tokens, all_logits=False)
        return self.first_token(logits[0]) if sample else (None, None)

    def first_token(self, last_logits: np.ndarray) -> tuple[int, float | None]:
        """The token after the prompt, from the prompt's last logits row (fed whole or in chunks)."""
        token, u = sample_at(target_probs(last_logits, self.params), self.seed, self.cache.length)
        self.draws += u is not None
        return token, u

    def conclude(
        self, logits: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None,
        parents: list[int] | None = None,
    ) -> Verdict:  # fmt: skip
        """Apply the acceptance rule to a forward over [pending, *drafts] (a chain, or the token
        tree whose node i continues node parents[i], run as `tree.rows_parents(parents)`) and keep
        only the accepted tokens' K/V."""
        start = self.cache.length - len(drafts)  # the position row 0 decides: right after `pending`
        probs = target_probs(logits, self.params)
        if parents is None:
            verdict = verify(drafts, draft_probs, probs, self.seed, start)
            self.cache.truncate(start + verdict.accepted)
        else:
            verdict = verify_tree(drafts, parents, probs, self.seed, start)
            self.cache.keep(start - 1, [0, *(node + 1 for node in verdict.path)])
        # A rejected deterministic draft's number also chose its replacement: count it once.
        self.draws += len({*(d.u for d in verdict.decisions), verdict.final_u} - {None})
        return verdict
