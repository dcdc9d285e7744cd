"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the
context's last n tokens (longest n first), as vLLM's n-gram proposer and transformers'
prompt lookup do. Free to run, and strong whenever the output quotes its input."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.decoding.drafters import EMPTY, NoDrafter, Proposal, tree_proposal
from pipeline.decoding.sampling import SamplingParams

MAX_MATCHES = 16  # the most recent matches a tree is built from


def matches(context: np.ndarray, min_n: int, max_n: int) -> tuple[int, np.ndarray]:
    """(n, where each earlier match of the longest matching suffix n-gram ends), oldest first."""
    length = context.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        # Windows that start early enough to have at least one token after them.
        windows = sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            return n, hits + n
    return 0, np.zeros(0, np.int64)


def lookup(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    _, ends = matches(context, min_n, max_n)
    return context[ends[-1] : ends[-1] + k].tolist() if ends.size else []


def candidates(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[tuple[list[int], float]]:
    """What followed each of the latest matches (up to k tokens each), weighted equally but for a
    hair more the more recent, so the newest wins a tie as in `lookup`; the weights sum to 1."""
    _, ends = matches(context, min_n, max_n)
    ends = ends[-MAX_MATCHES:]
    weights = 1.0 + 0.01 * np.arange(ends.size)
    weights /= weights.sum() if ends.size else 1.0
    return [(context[e : e + k].tolist(), float(w)) for e, w in zip(ends, weights, strict=True)]


class NgramDrafter(NoDrafter):
    """Stateless: it reads the context each step, so accept/finish stay no-ops."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, context: Sequence[int], k: int, tree: bool = False) -> Proposal:
        if k <= 0:
            return EMPTY
        if tree:
            return tree_proposal(self.name, self.candidates(context, k), k)
        tokens = lookup(np.asarray(context), k, self.min_n, self.max_n)
        return Proposal(tokens, None, self.name) if tokens else EMPTY

    def candidates(self, context: Sequence[int], k: int) -> list[tuple[list[int], float]]:
        return candidates(np.asarray(context), k, self.min_n, self.max_n)


class NgramSource:
    name = "ngram"

    def __init__(self, min_n: int = 3, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> NgramDrafter:
        return NgramDrafter(self.min_n, self.max_n)
