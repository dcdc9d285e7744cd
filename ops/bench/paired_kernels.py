"""Two builds of the native kernels, timed against each other in one process, on the default model.

Why paired: on the VMs this project runs on, a forward's time moves by 10-30% within minutes, far
more than most kernel changes are worth. Here the two builds' `forward_layers` take turns, forward
for forward, on caches of the same contexts, so the machine's mood falls on both alike; printed per
case: each build's median and the median of the paired differences (other - this, ms; positive:
this build is faster), and whether the two builds chose the same next token.

`--other` is the other build's `rowkernels.so`, for example the one a worktree of an earlier commit
builds into `~/.cache/speclanes/native/<key>/` on first use (`native.library_key()` names it), and
`--other-kv` its KV cache's element type (float32 before kernels.h's float16 `kv_t`).

    .venv/bin/python ops/bench/paired_kernels.py --other PATH [--other-kv float32] [--rounds 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.model import default_model_path, load_model, native, row_cache
from pipeline.model.cpu import cpu_name, kernel_flags

CASES = ((40, 1), (300, 1), (1000, 1), (2000, 1), (150, 8), (300, 8))  # (context, sequences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True)
    parser.add_argument("--other-kv", default=np.dtype(row_cache.KV_DTYPE).name)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    model = load_model(default_model_path())
    builds = {
        "this": (model.lib, row_cache.KV_DTYPE),
        "other": (native.load_library(args.other), np.dtype(args.other_kv).type),
    }
    print(f"{cpu_name()}, CPU flags {', '.join(kernel_flags())}; this build: {model.describe()}")
    print(f"the other build: {args.other}, KV cache {args.other_kv}; load {os.getloadavg()[0]:.2f}")
    for context, sequences in CASES:
        caches = {name: filled(model, build, context, sequences) for name, build in builds.items()}
        times: dict[str, list[float]] = {name: [] for name in builds}
        tokens = {}
        for round_ in range(args.rounds):
            for name in ("this", "other") if round_ % 2 else ("other", "this"):
                model.lib = model.head_products.lib = builds[name][0]
                start = time.perf_counter()
                logits = model.forward_batch([(cache, [5]) for cache in caches[name]], all_logits=False)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [int(row.argmax()) for row in logits]
                for cache in caches[name]:
                    cache.truncate(cache.length - 1)
        model.lib = model.head_products.lib = builds["this"][0]
        gain = statistics.median(o - t for o, t in zip(times["other"], times["this"], strict=True))
        medians = ", ".join(f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items())
        print(
            f"{context:>5} positions x {sequences} sequence(s): {medians}; paired other - this "
            f"{gain * 1e3:+.3f} ms; same next tokens: {tokens['this'] == tokens['other']}"
        )


def filled(model, build: tuple, context: int, sequences: int) -> list:
    """`sequences` caches of `context` positions each, made by `build` with its KV element type."""
    kept = model.lib, row_cache.KV_DTYPE
    model.lib, row_cache.KV_DTYPE = build
    caches = []
    for i in range(sequences):
        cache = model.new_cache(capacity=context + 16)
        ids = [100 + (i * 7 + j) % 500 for j in range(context)]
        for start in range(0, context, 256):
            model.forward(cache, ids[start : start + 256], all_logits=False)
        caches.append(cache)
    model.lib, row_cache.KV_DTYPE = kept
    return caches


if __name__ == "__main__":
    main()
