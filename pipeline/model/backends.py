"""Which runtime serves a model: the fast torch backend, or the numpy float32 reference.

`auto` takes torch wherever this machine can run it and says why when it cannot; naming a
backend explicitly never falls back: a machine that lacks it gives one clear error line.
A backend key ("torch:int4", "numpy:f32") names exactly which numbers were computed; it
travels with every verify result into the audit store, so `audit verify` recomputes a
request with the runtime that served it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from .config import ModelConfig
from .errors import BackendUnavailable

BACKENDS = ("auto", "torch", "numpy")
log = logging.getLogger(__name__)


class Runtime(Protocol):
    """What every backend offers: the Model interface the decoding core and lanes use."""

    cfg: ModelConfig
    backend: str
    weight_format: str
    step_bytes: int

    def new_cache(self, capacity: int = 256): ...
    def forward(self, cache, tokens, *, all_logits: bool = True) -> np.ndarray: ...
    def forward_batch(self, batch, *, all_logits: bool = True) -> list[np.ndarray]: ...
    def describe(self) -> str: ...


def backend_key(model: Runtime) -> str:
    return f"{model.backend}:{model.weight_format}"


def torch_problem() -> str | None:
    """Why the torch backend cannot run here, or None when it can."""
    from .native import compiler, have_compiler

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch==2.13.0)"
    if not have_compiler():
        return f"no C compiler ({compiler()}) for its row kernels"
    return None


def resolve_backend(name: str) -> str:
    """`name` made concrete for this machine; BackendUnavailable when asked for what it lacks."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        return name
    problem = torch_problem()
    if problem is None:
        return "torch"
    if name == "torch":
        raise BackendUnavailable(f"the torch backend cannot run on this machine: {problem}")
    log.warning("using the numpy reference backend: the torch backend cannot run here (%s)", problem)
    return "numpy"


def load_model(path: str | Path, backend: str = "auto", weight_format: str | None = None) -> Runtime:
    """The model at `path` on `backend` ("auto", "torch", "numpy", or a key such as "torch:int4")."""
    if ":" in backend:
        backend, weight_format = backend.split(":", 1)
    chosen = resolve_backend(backend)
    if chosen == "numpy":
        from .llama import Model

        if weight_format not in (None, "f32"):
            raise BackendUnavailable(f"the numpy backend computes in f32 only, not {weight_format!r}")
        return Model.load(path)
    from .torch_llama import TorchModel

    return TorchModel.load(path, weight_format)
