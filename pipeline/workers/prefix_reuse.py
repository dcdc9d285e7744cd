"""Prompt prefixes the verify lane already holds are copied, not computed again.

An Open whose tokens begin like tokens whose K/V some cache here already holds (a live
request's context, or a prompt part-way through its prefill) copies those positions
(`KVCache.adopt`) and forwards only the rest. The choices of one OpenAI request with `n` > 1
share their whole prompt: all but its last token are copied and that token is forwarded as
one row (some row must go through the model: its logits sample the first token). A system
prompt that many requests begin with is shared the same way.

Exact by construction on a row-invariant runtime: a position's K/V and logits depend only on
the tokens up to it, never on the forward that computed them, so the copied K/V are the bits
a full prefill writes and the rows forwarded after them are the rows it computes
(`tests/test_prefix_reuse.py`, with `array_equal`). The numpy reference is not row-invariant
(OpenBLAS sums a one-row product in another order than a block), so on it nothing is copied.

Prompts that arrive together (a request's n choices are opened within milliseconds) would
all be prefilled side by side in one forward. Instead a prompt waits while one ahead of it
is being fed that will hold at least half of what it still has to feed, then copies; so a
shared system prompt before a long question never delays the question by a forward, while
the n choices of one prompt cost one prefill plus one row each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from pipeline.model.llama import KVCache


class Feeding(Protocol):
    """A prompt being prefilled (the verifier's `Prefill`): its tokens, how many of them its
    cache holds, and how many of those were copied."""

    fed: int
    reused: int

    @property
    def tokens(self) -> list[int]: ...
    @property
    def cache(self) -> KVCache: ...
    def next_chunk(self, rows: int) -> list[int]: ...


Job = TypeVar("Job", bound=Feeding)


@dataclass(frozen=True)
class Holder:
    """A cache whose first positions hold the K/V of `tokens`."""

    tokens: Sequence[int]
    cache: KVCache

    @property
    def held(self) -> int:
        return min(len(self.tokens), self.cache.length)


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with in common."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])


def reusable(tokens: Sequence[int], other: Sequence[int]) -> int:
    """The positions of `tokens` that `other`'s K/V could stand for: never the last one."""
    return min(shared_length(tokens, other), len(tokens) - 1)


class PrefixReuse:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # the runtime is row-invariant
        self.reused = 0  # prompt positions copied instead of computed, over the lane's life

    def chunks(
        self, jobs: Sequence[Job], holders: Sequence[Holder], budget: int
    ) -> list[tuple[Job, list[int]]]:
        """This forward's share of the prompts being fed, oldest first, at most `budget` rows,
        after each has copied what the caches here hold of it; one that a prompt ahead of it will
        soon cover waits for it instead (and copies once, when it is done waiting)."""
        chunks: list[tuple[Job, list[int]]] = []
        for index, job in enumerate(jobs):
            if budget <= 0:
                break
            if self.enabled:
                fed = [Holder(other.tokens[: other.fed], other.cache) for other in jobs if other is not job]
                source, length = best_holder(job, [*holders, *fed])
                if self.waits(job, jobs[:index], length):
                    continue
                if source is not None:
                    self.adopt(job, source, length)
            chunk = job.next_chunk(budget)
            chunks.append((job, chunk))
            budget -= len(chunk)
        return chunks

    def adopt(self, job: Feeding, source: Holder, length: int) -> None:
        job.cache.adopt(source.cache, length)
        gained, job.fed = length - job.fed, length
        job.reused += gained
        self.reused += gained

    @staticmethod
    def waits(job: Feeding, ahead: Sequence[Feeding], held: int) -> bool:
        """Whether a prompt ahead of `job` will hold at least half of what `job` has left to feed
        once it has copied `held` positions."""
        left = len(job.tokens) - held
        return any(2 * (reusable(job.tokens, other.tokens) - held) >= left > 0 for other in ahead)


def best_holder(job: Feeding, holders: Sequence[Holder]) -> tuple[Holder | None, int]:
    """The holder of the longest prefix of `job`'s prompt beyond what `job` holds, and its length
    (`job.fed` and None if no holder has more)."""
    best, source = job.fed, None
    for holder in holders:
        length = reusable(job.tokens, holder.tokens[: holder.held]) if holder.held > best else 0
        if length > best and lends(holder.cache, length):
            best, source = length, holder
    return source, best


def lends(cache: KVCache, length: int) -> bool:
    """Whether `cache` still holds every K/V a copy of its first `length` positions needs: one whose
    sliding-window layers dropped positions a query there reads (`row_cache.RowCache.lends`) does
    not, and the prompt is prefilled instead."""
    check = getattr(cache, "lends", None)
    return check is None or bool(check(length))
