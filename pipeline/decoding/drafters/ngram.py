"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the
context's last n tokens (longest n first), as vLLM's n-gram proposer and transformers'
prompt lookup do. Free to run, and strong whenever the output quotes its input."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.decoding.drafters import EMPTY, NoDrafter, Proposal
from pipeline.decoding.sampling import SamplingParams


def lookup(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = context.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        # Windows that start early enough to have at least one token after them.
        windows = sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + k].tolist()
    return []


class NgramDrafter(NoDrafter):
    """Stateless: it reads the context each step, so accept/finish stay no-ops."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0:
            return EMPTY
        tokens = lookup(np.asarray(context), k, self.min_n, self.max_n)
        return Proposal(tokens, None, self.name) if tokens else EMPTY


class NgramSource:
    name = "ngram"

    def __init__(self, min_n: int = 3, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> NgramDrafter:
        return NgramDrafter(self.min_n, self.max_n)
