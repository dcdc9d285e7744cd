"""What this CPU can do, read at run time: machines here change from day to day.

The native kernels are compiled for the CPU they run on (`-march=native`, cached under a key
that includes these flags), so the flags decide the path: AVX512-VNNI products and AVX-512
attention where the CPU has them, portable C (the same bits) elsewhere. They are printed by
`bench model` and `status --json` beside the kernel path, so a figure can always be tied to
the machine that produced it.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

# The flags that decide a kernel path, in the order they are printed.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 /proc/cpuinfo); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_flags() -> list[str]:
    """The flags of KERNEL_FLAGS this CPU has, for printing beside a figure."""
    flags = cpu_flags()
    return [flag for flag in KERNEL_FLAGS if flag in flags]
