"""Draft with a learned head over the target's own features (EAGLE), a chain of the head's choices.

The target's feature at position p is its final-norm output there (`forward_features`); the side
that runs the target hands each kept position's feature to `observe`. The head's row p reads
[token p + 1; feature p] and predicts feature p + 1 and so the token at p + 2 (`model.draft_head`).
To draft after an accepted context x_0..x_n (x_n the pending token, whose feature is not computed
yet), the head feeds its rows up to n - 1 from true features, then continues on its own
predictions: each draft token's row reads the feature the previous row predicted.

Rows computed from true features stay in the head's KV cache across steps; rows from predictions
are dropped after each proposal. Where features are missing (the lane drafting restarted, so it holds
no history), the head starts from the first position it has a feature for: its attention then
sees a shorter history, which costs acceptance, never correctness.

Draft tokens are the head's choices, not samples: a deterministic drafter, so seeded output stays
identical to plain seeded decoding. Asked for a chain, it drafts the head's argmax up to k deep,
while the head gives the path at least MIN_PATH (and the controller's floor); asked
for a tree, each chain node also gets the head's runner-up beside it as a leaf (a row the verifier
pays for, with no head step). Each node's share is the head's probability of it, which the
controller weighs against the rows' cost (`Controller.cut`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pipeline.decoding.drafters import EMPTY, Candidates, Proposal, kinds
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.tree import chain
from pipeline.model.draft_head import DraftHead

# Draft no deeper than where the head gives the path this chance: a draft costs a head step (about
# a tenth of a target forward for the default model) plus a verify row, and earns its chance.
MIN_PATH = 0.15


def top_two(logits: np.ndarray) -> tuple[tuple[int, float], tuple[int, float]]:
    """The two likeliest draft-vocabulary indices, each with its probability.

    Two argmaxes and one float32 softmax: about 18 us for the default head's 6,144 logits with warm
    caches, where `argpartition` and a float64 softmax took 50, and about 0.11 ms called between two
    target forwards, about twice a step. The probabilities only steer the drafting, never the output."""
    best = int(np.argmax(logits))
    total = float(np.exp(logits - logits[best]).sum(dtype=np.float64))
    others = logits.copy()
    others[best] = -np.inf
    second = int(np.argmax(others))
    return (best, 1.0 / total), (second, math.exp(float(logits[second]) - float(logits[best])) / total)


class LearnedDrafter:
    name = "learned"

    def __init__(self, head: DraftHead) -> None:
        self.head = head
        self.cache = head.new_cache(capacity=64)
        self.base = 0  # the position of the head's row 0
        self.row_tokens: list[int] = []  # the token each cached (true) row read: rows base, base + 1, ...
        # The features of positions feat_at, feat_at + 1, ...: those not fed to the head yet, and the
        # last fed row's (a proposal with nothing new to feed feeds that row again for its prediction).
        self.feat_at = 0
        self.features = np.empty((0, head.cfg.d_model), np.float32)

    def observe(self, position: int, rows: np.ndarray) -> None:
        """The target's features at positions [position, position + len(rows))."""
        rows = np.asarray(rows, np.float32).reshape(-1, self.head.cfg.d_model)
        known = self.feat_at + len(self.features)
        if position > known or position < self.base:  # a gap, or history from before ours: start over
            self.base = self.feat_at = position
            self.features = rows.copy()
            self._drop_rows(0)
            return
        if position < self.feat_at:  # re-sent from before the features kept: they replace them
            self.feat_at, self.features = position, rows.copy()
        else:
            self.features = np.concatenate([self.features[: position - self.feat_at], rows])
        self._drop_rows(min(len(self.row_tokens), position - self.base))

    def _drop_rows(self, rows: int) -> None:
        del self.row_tokens[rows:]
        self.cache.truncate(rows)

    def _forget_fed(self) -> None:
        """Keep the features from the last fed row on."""
        keep_from = max(self.feat_at, self.base + len(self.row_tokens) - 1)
        self.features = self.features[keep_from - self.feat_at :]
        self.feat_at = keep_from

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        n = len(context) - 1  # the pending token's position
        true_end = min(self.feat_at + len(self.features), n)  # rows base..true_end-1 read true features
        if k <= 0 or true_end <= self.base or len(context) + k > self.head.cfg.context_length:
            return EMPTY
        cached = len(self.row_tokens)  # valid while the newest cached row read the token the context has
        if cached and self.row_tokens[-1] != context[self.base + cached]:
            cached = 0  # another context (a replayed step): rebuild from the features kept
        cached = min(cached, true_end - self.base - 1)  # at least one row to feed, for its prediction
        start = self.base + cached
        if start < self.feat_at:  # its features are gone: draft from those kept instead
            self.base, cached, start = self.feat_at, 0, self.feat_at
        self._drop_rows(cached)
        tokens = [int(t) for t in context[start + 1 : true_end + 1]]
        known = self.features[start - self.feat_at : true_end - self.feat_at]
        predicted, logits = self.head.step(self.cache, tokens, known)
        self.row_tokens.extend(tokens)
        self._forget_fed()
        feature, last = predicted[-1:], logits[-1]
        for p in range(true_end, n):  # context tokens past the known features: read predictions
            feature, rows = self.head.step(self.cache, [int(context[p + 1])], feature)
            last = rows[-1]
        drafts: list[int] = []  # the chain of the head's choices: node d is depth d + 1
        shares: list[float] = []
        leaves: list[tuple[int, int, float]] = []  # runners-up: (token, parent node, share)
        path = 1.0  # the head's odds of reaching the chain's end
        while len(drafts) + len(leaves) < k:
            (best, p_best), (second, p_second) = top_two(last)
            path *= p_best
            if path < max(floor, MIN_PATH):
                break
            drafts.append(int(self.head.vocab[best]))
            shares.append(p_best)
            if tree and len(drafts) + len(leaves) < k:  # the runner-up beside it: one more row, no head step
                leaves.append((int(self.head.vocab[second]), len(drafts) - 2, p_second))
            if len(drafts) + len(leaves) >= k:
                break
            feature, rows = self.head.step(self.cache, [drafts[-1]], feature)
            last = rows[-1]
        self.cache.truncate(len(self.row_tokens))  # predicted rows are dropped; true rows kept
        if not drafts:
            return EMPTY
        if not tree:
            return Proposal(drafts, None, self.name, None, shares)
        # The chain's nodes first, then the leaves: where the target keeps the chain's path, its rows
        # are already in their places in the verify cache (`KVCache.keep` moves none).
        tokens = [*drafts, *(token for token, _, _ in leaves)]
        parents = [*chain(len(drafts)), *(parent for _, parent, _ in leaves)]
        return Proposal(tokens, None, self.name, parents, [*shares, *(share for _, _, share in leaves)])

    def candidates(self, context: Sequence[int], k: int, floor: float = 0.0) -> Candidates:
        """The tree `propose` would draft, as weighted continuations (`drafters.Candidates`), so that
        `auto` merges them with the n-gram and suffix drafters' own: a node's path ends there with
        the weight the head gives the path, less what its children take."""
        proposal = self.propose(context, k, tree=True)
        parents = proposal.parents or list(range(-1, len(proposal.tokens) - 1))
        shares = proposal.shares or [1.0] * len(parents)
        weight, paths = [], []
        for node, parent in enumerate(parents):
            weight.append(shares[node] * (weight[parent] if parent >= 0 else 1.0))
            paths.append([*(paths[parent] if parent >= 0 else []), proposal.tokens[node]])
        ends = list(weight)
        for node, parent in enumerate(parents):
            if parent >= 0:
                ends[parent] -= weight[node]
        if not weight or weight[0] < floor:  # node 0 is the likeliest first token
            return []
        return [(path, end) for path, end in zip(paths, ends, strict=True) if end > 0]

    def accept(self, context: Sequence[int]) -> None:
        pass  # the context's new tokens come with their features, through observe

    def finish(self, context: Sequence[int]) -> None:
        self.cache = self.head.new_cache(capacity=1)


class LearnedSource:
    name = "learned"
    needs_features = kinds.needs_features(name)  # the target's features reach it through `observe`

    def __init__(self, head: DraftHead) -> None:
        self.head = head

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> LearnedDrafter:
        return LearnedDrafter(self.head)
