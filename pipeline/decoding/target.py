"""One request's state on the side that holds the target model: its KV cache and the
verifier's random stream."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict, verify
from pipeline.decoding.sampling import SamplingParams, sample_from, target_probs
from pipeline.model import Runtime


class TargetState:
    """`draws` counts the uniforms spent, so a restarted verifier can resume the same stream
    (`PCG64.advance`) and keep a seeded request reproducible."""

    def __init__(
        self, model: Runtime, params: SamplingParams, seed: int, *, draws: int = 0, capacity: int
    ) -> None:
        self.model, self.params, self.seed = model, params, seed
        bits = np.random.PCG64(seed)
        bits.advance(draws)
        self.rng, self.draws = np.random.Generator(bits), draws
        self.cache = model.new_cache(capacity=capacity)

    def prefill(self, tokens: Sequence[int], *, sample: bool = True) -> tuple[int | None, float | None]:
        """Feed `tokens`; sample the next token from the last position if asked."""
        logits = self.model.forward(self.cache, tokens, all_logits=False)
        return self.first_token(logits[0]) if sample else (None, None)

    def first_token(self, last_logits: np.ndarray) -> tuple[int, float | None]:
        """The token after the prompt, from the prompt's last logits row (fed whole or in chunks)."""
        token, u = sample_from(target_probs(last_logits, self.params), self.rng)
        self.draws += u is not None
        return token, u

    def conclude(self, logits: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None) -> Verdict:
        """Apply the acceptance rule to a forward over [pending, *drafts] and roll back."""
        verdict = verify(drafts, draft_probs, target_probs(logits, self.params), self.rng)
        self.cache.truncate(self.cache.length - len(drafts) + verdict.accepted)
        self.draws += sum(d.u is not None for d in verdict.decisions) + (verdict.final_u is not None)
        return verdict
