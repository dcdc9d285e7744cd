"""The token-keyed drafters hold what they saw, not the vocabulary: the same n-grams cost about the
same bytes whether their ids are a 49k model's or Gemma 3's (up to 262,143), a few hundred bytes
each, where a dense table over the vocabulary per n-gram would be hundreds of kilobytes.
ops/bench/drafter_memory.py gives the figures on real tokenizers' ids. (Not byte-equal: CPython's
free lists make what tracemalloc sees depend on what was freed before.)"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from pipeline.decoding.drafters.ngram import NgramIndex
from pipeline.decoding.drafters.suffix import SuffixDrafter, SuffixTable


def held_bytes(build) -> tuple[int, int]:
    """(bytes held, n-grams in the shared table)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table, index, drafter = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, len(table) + len(index.ends) + len(drafter.own)


def fill(requests: list[list[int]]) -> tuple[SuffixTable, NgramIndex, SuffixDrafter]:
    table = SuffixTable()
    for request in requests:
        table.add(request)
    index = NgramIndex(5)
    index.update(requests[0])
    return table, index, SuffixDrafter(table, requests[0])


def test_drafter_memory_does_not_grow_with_the_vocabulary():
    rng = np.random.default_rng(0)
    small = [(300 + rng.integers(0, 2000, 200)).tolist() for _ in range(20)]  # past CPython's cached ints
    large = [[t + 260_000 - 300 for t in r] for r in small]  # the same n-grams near Gemma 3's largest id
    assert max(max(r) for r in large) < 262_144
    fill(small)  # what a first fill allocates once (method caches) is not counted below
    small_bytes, ngrams = held_bytes(lambda: fill(small))
    large_bytes, same = held_bytes(lambda: fill(large))
    assert same == ngrams and large_bytes / ngrams < 1024
    assert abs(large_bytes - small_bytes) < 0.01 * small_bytes
