"""Forward cost by block size on top of a filled cache, against the memory floor.

A decode step must read every weight once, so `bytes read per step / streaming-read
bandwidth` is the floor no kernel can beat; verifying k draft tokens should cost
close to one step because the weights are read once for the whole block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..model import Model, default_model_path

BLOCK_SIZES = (1, 2, 4, 8, 16)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page in the weights, settle the thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def streaming_bandwidth(nbytes: int, repeats: int, threads: int) -> float:
    """Bytes/s of a read-and-reduce over a fresh buffer as large as the weights.

    It reads with as many threads as the forward's BLAS uses (numpy reductions release
    the GIL): one core alone cannot saturate memory, and the floor must be one the
    forward could actually reach.
    """
    chunks = np.array_split(np.ones(nbytes // 4, dtype=np.float32), threads)
    with ThreadPoolExecutor(threads) as pool:
        return nbytes / median_seconds(lambda: list(pool.map(np.sum, chunks)), repeats)


def measure(model: Model, context: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    prompt = rng.integers(17, model.cfg.vocab_size, size=context)
    cache = model.new_cache(capacity=context + max(BLOCK_SIZES))

    def prefill() -> None:
        cache.truncate(0)
        model.forward(cache, prompt, all_logits=False)

    prefill_s = median_seconds(prefill, max(3, repeats // 3))

    def block(t: int) -> Callable[[], None]:
        tokens = rng.integers(17, model.cfg.vocab_size, size=t)

        def run() -> None:
            model.forward(cache, tokens)
            cache.truncate(context)

        return run

    forward_s = {t: median_seconds(block(t), repeats) for t in BLOCK_SIZES}
    step_bytes = model.step_bytes
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or 1)
    floor_s = step_bytes / streaming_bandwidth(step_bytes, repeats, threads)
    return {
        "model": model.cfg.name,
        "context": context,
        "openblas": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")},
        "step_bytes": step_bytes,
        "memory_floor_ms": floor_s * 1e3,
        "prefill_ms": prefill_s * 1e3,
        "prefill_tokens_per_second": context / prefill_s,
        "forward_ms": {str(t): s * 1e3 for t, s in forward_s.items()},
        "ratio_to_t1": {str(t): s / forward_s[1] for t, s in forward_s.items()},
        "t1_over_floor": forward_s[1] / floor_s,
    }


def render(result: dict) -> str:
    lines = [
        f"model {result['model']}, {result['context']}-token cache, OpenBLAS {result['openblas']}",
        f"memory floor {result['memory_floor_ms']:.1f} ms ({result['step_bytes'] / 1e6:.0f} MB per step)",
        f"prefill {result['context']} tokens: {result['prefill_ms']:.0f} ms "
        f"({result['prefill_tokens_per_second']:.0f} tok/s)",
        "",
        f"{'T':>3} {'ms':>8} {'T(k)/T(1)':>10}",
    ]
    for t in result["forward_ms"]:
        lines.append(f"{t:>3} {result['forward_ms'][t]:>8.1f} {result['ratio_to_t1'][t]:>10.2f}")
    lines.append(f"\nT(1) / floor = {result['t1_over_floor']:.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    model = Model.load(args.model or default_model_path())
    result = measure(model, args.context, args.repeats)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
