"""Draft with a smaller model that shares the target's vocabulary.

The draft model keeps its own KV cache per request. It feeds whatever accepted tokens
it has not seen, then runs k single-token steps, drawing each token from the same
shaped distribution (logit bias and penalties over the context and the drafts before it,
temperature, min-p, top-k, top-p) the target uses: those rows are the p of the acceptance
rule. After verification its cache is truncated to the accepted prefix, the same rollback
the target does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.controls import shaped_probs
from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.noise import DRAFT
from pipeline.decoding.sampling import SamplingParams, sample_at
from pipeline.model import Runtime
from pipeline.model.errors import ModelFileError
from pipeline.model.store import Front


def check_same_vocabulary(target: Runtime | Front, draft: Runtime) -> None:
    assert target.tokenizer is not None and draft.tokenizer is not None
    if target.cfg.vocab_size != draft.cfg.vocab_size or (
        target.tokenizer.hf.get_vocab() != draft.tokenizer.hf.get_vocab()
    ):
        raise ModelFileError(
            f"the draft model {draft.cfg.name!r} does not share the target's vocabulary "
            f"({draft.cfg.vocab_size} vs {target.cfg.vocab_size} tokens, or different token strings)"
        )


class ModelDrafter:
    name = "model"

    def __init__(self, model: Runtime, params: SamplingParams, seed: int, prompt_length: int = 0) -> None:
        self.model, self.params, self.seed = model, params, seed
        self.prompt_length = prompt_length  # where the prompt ends in a context: penalties read it
        self.cache = model.new_cache()
        self.fed: list[int] = []  # tokens whose K/V are in the draft cache

    def _sync(self, context: Sequence[int]) -> None:
        """Roll the cache back to the longest common prefix with `context`."""
        common = 0
        limit = min(len(self.fed), len(context))
        while common < limit and self.fed[common] == context[common]:
            common += 1
        try:
            self.cache.truncate(common)
        except ValueError:  # a sliding-window draft cache (Gemma 3) no longer holds what `common` reads
            common = 0
            self.cache.truncate(0)
        del self.fed[common:]

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        k = min(k, self.model.cfg.context_length - len(context))
        if k <= 0:
            return EMPTY
        self._sync(context)
        if len(self.fed) == len(context):  # the last token's logits are not kept: feed it again
            self._sync(context[:-1])
        pending = list(context[len(self.fed) :])
        tokens: list[int] = []
        rows = []
        for j in range(k):  # draft j sits at position len(context) + j: its own number samples it
            logits = self.model.forward(self.cache, pending, all_logits=False)[0]
            self.fed.extend(pending)
            probs = shaped_probs(logits[None], self.params, context, self.prompt_length, [tokens])[0]
            token, _ = sample_at(probs, self.seed, len(context) + j, DRAFT)
            tokens.append(token)
            rows.append(probs)
            pending = [token]
        # float32 rows: what crosses the wire to a remote verifier, so both paths verify the same p.
        return Proposal(tokens, None if self.params.greedy else np.stack(rows).astype(np.float32), self.name)

    def accept(self, context: Sequence[int]) -> None:
        self._sync(context)

    def finish(self, context: Sequence[int]) -> None:
        self.cache = self.model.new_cache(capacity=1)


class ModelSource:
    name = "model"

    def __init__(self, draft: Runtime, target: Runtime | Front) -> None:
        check_same_vocabulary(target, draft)
        self.draft = draft

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> ModelDrafter:
        return ModelDrafter(self.draft, params, seed, len(prompt))
