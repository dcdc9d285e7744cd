"""Which runtime serves a model: native (the default), torch, or the numpy float32 reference.

- native: the GGUF's own 4- to 8-bit blocks times 8-bit activations with exact integer sums, in C
  kernels built for this CPU (AVX512-VNNI where it has it, portable C with the same bits
  elsewhere); the fastest row-invariant path measured on every machine so far.
- torch: torch's int4 group-32 (or bf16) products around the same row-invariant C kernels.
- numpy: the float32 reference, the oracle in tests; not row-invariant (see llama.Model).

`auto` takes native wherever this machine can build its kernels and says why when it cannot;
naming a backend explicitly never falls back: a machine that lacks it gives one clear error
line. A backend key ("native:q8", "torch:int4", "numpy:f32") names exactly which numbers were
computed; it travels with every verify result into the audit store, so `audit verify`
recomputes a request with the runtime that served it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.errors import BackendUnavailable

BACKENDS = ("auto", "native", "torch", "numpy")
log = logging.getLogger(__name__)


class Runtime(Protocol):
    """What every backend offers: the Model interface the decoding core and lanes use."""

    cfg: ModelConfig
    backend: str
    weight_format: str
    step_bytes: int
    row_invariant: bool  # a position's logits never depend on the forward that computed them
    embed: np.ndarray  # (vocab, d) float32 input embedding rows

    def new_cache(self, capacity: int = 256): ...
    def forward(self, cache, tokens, *, all_logits: bool = True) -> np.ndarray: ...
    def forward_batch(self, batch, *, all_logits: bool = True) -> list[np.ndarray]: ...
    def forward_features(
        self, batch, *, all_logits: bool | Sequence[bool] = True, features: bool = True
    ) -> tuple[list[np.ndarray], list[np.ndarray]]: ...
    def describe(self) -> str: ...


def backend_key(model: Runtime) -> str:
    return f"{model.backend}:{model.weight_format}"


def backend_problem(name: str) -> str | None:
    """Why backend `name` cannot run here, or None when it can."""
    from pipeline.model.native import compiler, have_compiler

    if name == "torch" and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch==2.13.0)"
    if not have_compiler():
        return f"no C compiler ({compiler()}) for its kernels"
    return None


def resolve_backend(name: str) -> str:
    """`name` made concrete for this machine; BackendUnavailable when asked for what it lacks."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        return name
    concrete = "native" if name == "auto" else name
    problem = backend_problem(concrete)
    if problem is None:
        return concrete
    if name != "auto":
        raise BackendUnavailable(f"the {name} backend cannot run on this machine: {problem}")
    log.warning("using the numpy reference backend: the native backend cannot run here (%s)", problem)
    return "numpy"


def set_backend(settings: list[str]) -> str:
    """The backend a list of `--set SECTION.KEY=VALUE` overrides gives a pipeline (auto if none):
    benchmarks decode in-process on the same runtime as the pipelines they compare against."""
    return next((s.split("=", 1)[1] for s in reversed(settings) if s.startswith("model.backend=")), "auto")


def load_model(path: str | Path, backend: str = "auto", weight_format: str | None = None) -> Runtime:
    """The model at `path` on `backend` ("auto", "native", "torch", "numpy", or a key "torch:int4")."""
    if ":" in backend:
        backend, weight_format = backend.split(":", 1)
    chosen = resolve_backend(backend)
    if chosen == "numpy":
        from pipeline.model.llama import Model

        if weight_format not in (None, "f32"):
            raise BackendUnavailable(f"the numpy backend computes in f32 only, not {weight_format!r}")
        return Model.load(path)
    from pipeline.model.fast_store import load_fast

    return load_fast(Path(path), chosen, weight_format)
