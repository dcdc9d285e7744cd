"""What AMX-INT8 tiles could save the native products on this machine: a measured bound.

Builds and runs `amx_tiles.c` (needs a C compiler and a CPU with amx_int8), which times, per
block of 32 inputs and 16 outputs, the integer sums of 16 rows through the tiles (load weights,
load activations, TDPBSUD, TILESTORED). The native products need those sums per block, since
each block has its own scales (products.c), so the tile store is paid per block: this is what
bounds an AMX path, whatever is built around it. Beside it: what one more row costs the native
VNNI products per block today, integer sums and float sequence together (`gemm_blocks` on one
thread, 16 rows against 1, a 4096 x 4096 Q4_1 matrix).

    .venv/bin/python ops/bench/amx_bound.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # before libgomp loads: one core's cost, as the tile loop's
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from pipeline.model.fast_products import NativeProducts
from pipeline.model.native import row_kernels
from pipeline.model.native_weights import QuantBlocks, pack

SOURCE = Path(__file__).with_name("amx_tiles.c")


def vnni_row_block_ns(n: int = 4096) -> float:
    """What a 16th row adds per (16 outputs, block of 32) to the native products, in ns."""
    rng = np.random.default_rng(0)
    d = (rng.standard_normal((n, n // 32)) * 0.01).astype(np.float16)
    matrix = pack(QuantBlocks("Q4_1", rng.integers(0, 16, (n, n)).astype(np.uint8), d, d))
    products = NativeProducts(row_kernels())

    def best(rows: int) -> float:
        a = products.prepare(rng.standard_normal((rows, n)).astype(np.float32))
        times = []
        for _ in range(9):
            start = time.perf_counter()
            products.apply(a, matrix)
            times.append(time.perf_counter() - start)
        return min(times)

    blocks = (n // 16) * (n // 32)
    return (best(16) - best(1)) / 15 / blocks * 1e9


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_int8" not in flags:
        print("this CPU has no amx_int8: nothing to measure")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "amx_tiles"
        subprocess.run(["cc", "-O2", "-march=native", str(SOURCE), "-o", str(binary)], check=True)
        result = json.loads(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout)
    amx, store = result["amx_per_row_block_ns"], result["tilestored_ns"] / 16
    vnni = vnni_row_block_ns()
    print(
        f"one block of 32 inputs x 16 outputs x 16 rows through the tiles: {result['tile_block_ns']:.1f} ns "
        f"(TDPBSUD alone {result['tdpbsud_ns']:.1f}, TILESTORED alone {result['tilestored_ns']:.1f})\n"
        f"per row and block: AMX integer sums {amx:.2f} ns, of which the tile store {store:.2f} ns; "
        f"native VNNI products today, sums and float sequence {vnni:.2f} ns\n"
        f"an AMX path adds the float sequence to its {amx:.2f} ns: it can save at most "
        f"{max(0.0, 1 - amx / vnni):.0%} of a row's product cost, before that sequence"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
