"""The runtime's own t(rows) curve: how long a forward of r new rows takes on this machine.

The speculation controller (`decoding.adaptive`) chooses how many draft nodes to verify from
this curve, so it is measured where it is used, not assumed: it differs between backends, CPUs
and models (flat up to a knee on a wide-SIMD CPU, rising from the start on a compute-bound
one). A few row counts are timed over a cache of `CONTEXT` tokens, in `ROUNDS` interleaved rounds,
the median of each, made non-decreasing; the controller interpolates between them.

The verify lane measures it at its first start on a machine and keeps it beside the model's
prepared weights (`stored_row_seconds`, per runtime, kernel build and CPU: new kernels mean a new
curve), so a restarted lane is back without the second it takes; delete that directory's
`calibration/` to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from pipeline.model.backends import Runtime, backend_key
from pipeline.model.cpu import cpu_name, kernel_flags
from pipeline.model.native import library_key
from pipeline.model.sealed import seal_file
from pipeline.model.store import form_directory, intact_file

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)
CONTEXT = 256
ROUNDS = 11
_measured: weakref.WeakKeyDictionary[Any, list[float]] = weakref.WeakKeyDictionary()


def measure(model: Runtime, rows: tuple[int, ...] = ROWS) -> list[float]:
    """Seconds by row count: entry r - 1 is t(r), 0.0 where r was not timed.

    Each round times every row count once, in turn, and each figure is the median over the rounds:
    a step's forward follows forwards of other sizes, and what the controller weighs is what a step
    costs as a rule. The fastest of back-to-back repeats instead, as this once took, read t(8) / t(1)
    as 1.4 on a machine where steps of 8 rows cost 2.0 (the best of two runs of a noisy 2-thread
    forward is a lucky one), and the controller verified twice the rows that paid."""
    context = min(CONTEXT, model.cfg.context_length - max(rows) - 1)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(capacity=context + max(rows) + 1)
    model.forward(cache, [(7 * i + 1) % vocab for i in range(max(1, context))], all_logits=False)
    base = cache.length
    timings: dict[int, list[float]] = {r: [] for r in rows}
    for round_ in range(-1, ROUNDS):  # round -1 warms up
        for r in rows:
            t0 = time.perf_counter()
            model.forward(cache, [(3 * i + 2 + round_) % vocab for i in range(r)])
            if round_ >= 0:
                timings[r].append(time.perf_counter() - t0)
            cache.truncate(base)
    out = [0.0] * max(rows)
    # More rows never cost less: a timing that says so is noise from the rest of the machine.
    longest = 0.0
    for r in rows:
        longest = out[r - 1] = max(statistics.median(timings[r]), longest)
    return out


def row_seconds(model: Runtime) -> list[float]:
    """`measure(model)`, once per loaded model."""
    try:
        return _measured[model]
    except KeyError:
        seconds = _measured[model] = measure(model)
        return seconds


def stored_row_seconds(model: Runtime, path: Path) -> list[float]:
    """`measure(model)` for the model file at `path`, kept beside its prepared weights
    (`store.form_directory`) per runtime, kernel build (`native.library_key`: the C sources, flags
    and CPU flags) and CPU; written atomically and sealed, an unreadable or damaged entry is
    measured again. A curve read back is also `row_seconds(model)` from then on: whatever asks this
    model's curve next (an in-process `decode`, a test's second worker) reads it, not the clock."""
    how = [ROWS, CONTEXT, ROUNDS, "median"]  # a new way of measuring: a new curve
    key = json.dumps([backend_key(model), library_key(), cpu_name(), kernel_flags(), *how])
    entry = form_directory(path, "calibration") / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        if not intact_file(entry):
            raise ValueError("no intact entry")
        seconds = json.loads(entry.read_text())
        if isinstance(seconds, list) and len(seconds) == max(ROWS) and all(type(x) is float for x in seconds):
            _measured[model] = seconds
            return seconds
    except (OSError, ValueError):
        pass
    seconds = row_seconds(model)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False, suffix=".tmp") as f:
        json.dump(seconds, f)
    os.replace(f.name, entry)
    seal_file(entry)
    return seconds
