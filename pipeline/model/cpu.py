"""What this CPU can do, read at run time: machines here change from day to day.

The flags decide the torch backend's weight format (`choose_format`) and are printed by
`bench model`, `status --json` and the audit record, so a figure or a recomputation can
always be tied to the kernel path that produced it.
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


def choose_format() -> str:
    """The torch backend's weight format for this machine, from measurements (FINDINGS.md, README).

    int4 group-32 (`_weight_int4pack_mm_for_cpu`) was the fastest row-invariant product for one to
    about twelve rows on both machines measured, an AMD Zen 4 and an Intel Xeon with AMX; it needs
    AVX2 at least to be fast. Without AVX2 the format is bf16, whose oneDNN path runs anywhere.
    """
    return "int4" if "avx2" in cpu_flags() else "bf16"
