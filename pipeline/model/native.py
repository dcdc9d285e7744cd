"""Builds and loads `rowkernels.c`, the torch backend's row-invariant non-product kernels.

They are compiled on first use with the machine's C compiler for the machine's own CPU
(`-march=native`), into the weight cache under a key of the source, the flags and the CPU
flags, so a machine never loads a library built for another. `-ffp-contract=off` and no
fast-math keep every sum in the order the source writes it (see the file's header).
The library links OpenMP by its soname, so it shares the thread pool torch has already
loaded instead of bringing a second one that would spin against it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from .cpu import cpu_flags
from .errors import BackendUnavailable
from .store import cache_root

SOURCE = Path(__file__).with_name("rowkernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "rms_norm_bf16": (_P, _I, _I, _P, _F, _P),
    "rms_norm_f32": (_P, _I, _I, _P, _F, _P),
    "add_rms_norm_bf16": (_P, _P, _I, _I, _P, _F, _P),
    "add_bf16": (_P, _P, _I),
    "silu_mul_bf16": (_P, _I, _I, _P),
    "rope_attend_bf16": (_P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P),
    "head_q8_0": (_P, _I, _I, _P, _P, _I, _P),
}


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def library_key() -> str:
    text = SOURCE.read_bytes() + " ".join((compiler(), *FLAGS, *sorted(cpu_flags()))).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler(), *FLAGS, str(SOURCE), "-o", staging, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendUnavailable(f"the torch backend's row kernels need a C compiler ({exc})") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise BackendUnavailable(f"compiling the torch backend's row kernels failed: {last}")
        os.replace(staging, target)  # atomic: a concurrent loader sees the whole file or none
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)


@cache
def row_kernels() -> ctypes.CDLL:
    """The loaded library, built first if this machine has none yet."""
    import torch  # noqa: F401  (loads torch's libgomp first, so the library shares its thread pool)

    target = cache_root() / "native" / library_key() / "rowkernels.so"
    if not target.is_file():
        _build(target)
    library = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, None
    return library


def have_compiler() -> bool:
    return shutil.which(compiler()) is not None
