"""The runtime's own t(rows) curve: how long a forward of r new rows takes on this machine.

The speculation controller (`decoding.adaptive`) chooses how many draft nodes to verify from
this curve, so it is measured where it is used, at start-up, not assumed: it differs between
backends, CPUs and load (flat up to a knee on a wide-SIMD CPU, rising from the start on a
compute-bound one). A few row counts are timed over a cache of `CONTEXT` tokens, the fastest
of `REPEATS` runs each, made non-decreasing; the controller interpolates between them.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from pipeline.model.backends import Runtime

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 33)
CONTEXT = 128
REPEATS = 3
_measured: weakref.WeakKeyDictionary[Any, list[float]] = weakref.WeakKeyDictionary()


def measure(model: Runtime, rows: tuple[int, ...] = ROWS) -> list[float]:
    """Seconds by row count: entry r - 1 is t(r), 0.0 where r was not timed."""
    context = min(CONTEXT, model.cfg.context_length - max(rows) - 1)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(capacity=context + max(rows) + 1)
    model.forward(cache, [(7 * i + 1) % vocab for i in range(max(1, context))], all_logits=False)
    base = cache.length
    out = [0.0] * max(rows)
    for r in rows:
        best = float("inf")
        for _ in range(REPEATS + (r == rows[0])):  # the first forward of all also warms up
            t0 = time.perf_counter()
            model.forward(cache, [(3 * i + 2) % vocab for i in range(r)])
            best = min(best, time.perf_counter() - t0)
            cache.truncate(base)
        out[r - 1] = best
    # More rows never cost less: a timing that says so is noise from the rest of the machine.
    longest = 0.0
    for r in rows:
        longest = out[r - 1] = max(out[r - 1], longest)
    return out


def row_seconds(model: Runtime) -> list[float]:
    """`measure(model)`, once per loaded model."""
    try:
        return _measured[model]
    except KeyError:
        seconds = _measured[model] = measure(model)
        return seconds
