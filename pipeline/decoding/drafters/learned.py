"""Draft with a learned head over the target's own features (EAGLE), a chain of the head's choices.

The target's feature at position p is its final-norm output there (`forward_features`); the side
that runs the target hands each kept position's feature to `observe`. The head's row p reads
[token p + 1; feature p] and predicts feature p + 1 and so the token at p + 2 (`model.draft_head`).
To draft after an accepted context x_0..x_n (x_n the pending token, whose feature is not computed
yet), the head feeds its rows up to n - 1 from true features, then continues on its own
predictions: each draft token's row reads the feature the previous row predicted.

Rows computed from true features stay in the head's KV cache across steps; rows from predictions
are dropped after each proposal. Where features are missing (a draft lane restarted, so it holds
no history), the head starts from the first position it has a feature for: its attention then
sees a shorter history, which costs acceptance, never correctness.

Draft tokens are the head's argmax, not samples: a deterministic drafter, so seeded output stays
identical to plain seeded decoding. Each node's share is the head's probability of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.sampling import SamplingParams
from pipeline.model.draft_head import DraftHead


def softmax_top(logits: np.ndarray) -> tuple[int, float]:
    """The likeliest draft-vocabulary index and its probability."""
    best = int(np.argmax(logits))
    z = np.exp(logits.astype(np.float64) - float(logits[best]))
    return best, float(1.0 / z.sum())


class LearnedDrafter:
    name = "learned"

    def __init__(self, head: DraftHead) -> None:
        self.head = head
        self.cache = head.new_cache(capacity=64)
        self.base = 0  # the first position with a known feature
        self.features = np.empty((0, head.cfg.d_model), np.float32)  # positions base, base + 1, ...
        self.row_tokens: list[int] = []  # the token each cached (true) row read, rows base, base + 1, ...

    def observe(self, position: int, rows: np.ndarray) -> None:
        """The target's features at positions [position, position + len(rows))."""
        known = self.base + len(self.features)
        rows = np.asarray(rows, np.float32).reshape(-1, self.head.cfg.d_model)
        if position > known or position < self.base:  # a gap, or history from before ours: start over
            self.base, self.features = position, rows.copy()
            self._drop_rows(0)
            return
        self.features = np.concatenate([self.features[: position - self.base], rows])
        self._drop_rows(min(len(self.row_tokens), position - self.base))

    def _drop_rows(self, rows: int) -> None:
        del self.row_tokens[rows:]
        self.cache.truncate(rows)

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        n = len(context) - 1  # the pending token's position
        true_end = min(self.base + len(self.features), n)  # rows base..true_end-1 read true features
        if k <= 0 or true_end <= self.base or len(context) + k > self.head.cfg.context_length:
            return EMPTY
        cached = 0  # rows still valid: they read the tokens the context now has
        while cached < len(self.row_tokens) and self.row_tokens[cached] == context[self.base + cached + 1]:
            cached += 1
        self._drop_rows(cached)
        if cached == true_end - self.base:  # nothing new to feed: refeed the last row for its prediction
            self._drop_rows(cached - 1)
            cached -= 1
        positions = range(self.base + cached, true_end)
        tokens = [int(context[p + 1]) for p in positions]
        known = self.features[positions.start - self.base : positions.stop - self.base]
        predicted, logits = self.head.step(self.cache, tokens, known)
        self.row_tokens.extend(tokens)
        feature, last = predicted[-1:], logits[-1]
        for p in range(true_end, n):  # context tokens past the known features: read predictions
            feature, rows = self.head.step(self.cache, [int(context[p + 1])], feature)
            last = rows[-1]
        drafts: list[int] = []
        shares: list[float] = []
        for _ in range(k):
            index, share = softmax_top(last)
            drafts.append(int(self.head.vocab[index]))
            shares.append(share)
            if len(drafts) == k:
                break
            feature, rows = self.head.step(self.cache, [drafts[-1]], feature)
            last = rows[-1]
        self.cache.truncate(len(self.row_tokens))  # predicted rows are dropped; true rows kept
        return Proposal(drafts, None, self.name, None, shares)

    def accept(self, context: Sequence[int]) -> None:
        pass  # the context's new tokens come with their features, through observe

    def finish(self, context: Sequence[int]) -> None:
        self.cache = self.head.new_cache(capacity=1)


class LearnedSource:
    name = "learned"
    needs_features = True

    def __init__(self, head: DraftHead) -> None:
        self.head = head

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> LearnedDrafter:
        return LearnedDrafter(self.head)
