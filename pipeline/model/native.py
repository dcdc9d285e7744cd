"""Builds and loads the fast runtime's C kernels: `rowkernels.c` (norms, RoPE and attention, SiLU),
`products.c` (the GGUF's 4-, 5-, 6- and 8-bit blocks times 8-bit activations), `layers.c` (a
forward's layers) and `draw.c` (a sampled row's inverse-CDF draw).

They are compiled on first use with the machine's C compiler for the machine's own CPU
(`-march=native`), into the weight cache under a key of the source, the flags and the CPU
flags, so a machine never loads a library built for another. `-ffp-contract=off` and no
fast-math keep every sum in the order the source writes it (see the file's header).
The library links OpenMP by its soname (libgomp.so.1), so in a process that has imported torch
it shares torch's thread pool instead of bringing a second one that would spin against it.
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

from pipeline.model.cpu import cpu_flags
from pipeline.model.errors import BackendUnavailable
from pipeline.model.sealed import seal_file
from pipeline.model.store import cache_root, intact_file

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("rowkernels.c", "products.c", "layers.c", "draw.c")
)
HEADERS = (Path(__file__).with_name("kernels.h"),)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "rms_norm_f32": (_P, _I, _I, _P, _F, _P),
    "add_rms_norm_f32": (_P, _P, _I, _I, _P, _F, _P),
    "add_f32": (_P, _P, _I),
    "silu_mul_f32": (_P, _I, _I, _P),
    "gelu_mul_f32": (_P, _I, _I, _P),
    "quantize_q8": (_P, _I, _I, _P, _P, _P, _P),
    "gemm_blocks": (_P, _P, _P, _P, _I, _I, _P, _I, _I, _P, _I, _I),
    "has_vnni": (),
    "draw_f64": (_P, ctypes.c_long, ctypes.c_double, _P, _P),
}


RESTYPES = {"has_vnni": ctypes.c_int, "draw_f64": ctypes.c_long}  # the rest return nothing

MAX_PARTS = 3  # layers.c


class CPart(ctypes.Structure):
    _fields_ = (("data", _P), ("kind", _I), ("n_out", _I))


class CMatrix(ctypes.Structure):
    _fields_ = (("parts", CPart * MAX_PARTS), ("n_parts", _I), ("n_out", _I), ("n_in", _I), ("streamed", _I))


class CLayer(ctypes.Structure):
    _fields_ = (("attn_norm", _P), ("ffn_norm", _P), ("bias", _P), ("q_norm", _P), ("k_norm", _P),
                ("post_attn_norm", _P), ("post_ffw_norm", _P), ("cos", _P), ("sin", _P), ("window", _I),
                ("cache_index", _I), ("qkv", CMatrix), ("o", CMatrix), ("gate_up", CMatrix),
                ("down", CMatrix))  # fmt: skip


class CSequence(ctypes.Structure):
    _fields_ = (("first_row", _I), ("rows", _I), ("start", _I), ("cap", _I), ("local_cap", _I), ("base", _I),
                ("kt", _P), ("v", _P), ("local_kt", _P), ("local_v", _P), ("parents", _P))  # fmt: skip


class CAttend(ctypes.Structure):
    """kernels.h's AttendSpec: one layer's attention for rope_attend_f32 (the torch backend's loop)."""

    _fields_ = (("bias", _P), ("q_norm", _P), ("k_norm", _P), ("eps", _F), ("cos", _P), ("sin", _P),
                ("window", _I), ("base", _I))  # fmt: skip


class CScratch(ctypes.Structure):
    _fields_ = tuple(
        (name, _P) for name in ("h", "qkv", "attn", "gate_up", "act", "out", "xq", "dx", "sx", "sh")
    )


SIGNATURES["rope_attend_f32"] = (_P, ctypes.POINTER(CAttend), _I, _I, _P, _P, _P, _I, _I, _I, _I, _F, _P)
SIGNATURES["forward_layers"] = (
    _P,
    _I,
    _I,
    _I,
    _I,
    _I,
    _I,
    _F,
    _F,
    _I,
    ctypes.POINTER(CLayer),
    _I,
    ctypes.POINTER(CSequence),
    _I,
    ctypes.POINTER(CScratch),
)


def compiler() -> str:
    return os.environ.get("CC") or "cc"


LAYOUT = b"sealed-1"  # how a build is kept (sealed.py): a new layout builds afresh, unwarned


def library_key() -> str:
    text = (
        LAYOUT
        + b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
        + " ".join((compiler(), *FLAGS, *sorted(cpu_flags()))).encode()
    )
    return hashlib.sha256(text).hexdigest()[:16]


def _build(target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler(), *flags, *map(str, SOURCES), "-o", staging, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendUnavailable(f"the fast backends' kernels need a C compiler ({exc})") from None
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            last = next((line for line in lines if "error" in line), lines[-1])
            raise BackendUnavailable(f"compiling the fast backends' kernels failed: {last}")
        os.replace(staging, target)  # atomic: a concurrent loader sees the whole file or none
        seal_file(target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)


@cache
def row_kernels() -> ctypes.CDLL:
    """The loaded library, built first if this machine has none yet."""
    target = cache_root() / "native" / library_key() / "rowkernels.so"
    if not intact_file(target):  # a damaged library would die of SIGILL or load wrong code
        _build(target)
    return load_library(target)


def loaded_kernels() -> ctypes.CDLL | None:
    """The library if this process has loaded it (a native model did), else None: a caller that has
    a numpy path of the same bits (sampling's draw) never makes a process build it."""
    return row_kernels() if row_kernels.cache_info().currsize else None


def load_library(target: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, RESTYPES.get(name)
    return library


def have_compiler() -> bool:
    return shutil.which(compiler()) is not None
