"""llama.cpp's step times for `bench model`, run as a child process: python -m ... PATH CONTEXT REPEATS.

The same cache length and block sizes as the speclanes rows; two threads like the kernels here.
Prints one JSON object; a crash (llama.cpp's AMX path on some Intel machines) shows as the
child's signal in the parent's table instead of taking the benchmark down.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from pipeline.bench.model_bench import BLOCK_SIZES


def main() -> None:
    import llama_cpp

    path, context, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = llama_cpp.Llama(model_path=path, n_ctx=context + 64, n_threads=2, verbose=False, logits_all=True)
    rng = np.random.default_rng(0)
    model.reset()
    model.eval(rng.integers(17, 40000, size=context).tolist())
    forward_ms = {}
    for t in BLOCK_SIZES:
        tokens = rng.integers(17, 40000, size=t).tolist()
        times = []
        for _ in range(repeats + 1):
            model.n_tokens = context  # roll back to the filled cache, as the speclanes rows do
            start = time.perf_counter()
            model.eval(tokens)
            times.append(time.perf_counter() - start)
        forward_ms[str(t)] = statistics.median(times[1:]) * 1e3
    print(json.dumps({"version": llama_cpp.__version__, "forward_ms": forward_ms}))


if __name__ == "__main__":
    main()
