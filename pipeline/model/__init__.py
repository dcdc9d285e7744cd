"""The model runtime: GGUF loading, prepared-weight caches, and two backends behind one interface.

- `llama.Model`: the numpy float32 reference (the oracle in tests);
- `torch_llama.TorchModel`: the fast backend users run (int4 products, row-invariant C kernels);
- `backends.load_model`: picks one for this machine (`cpu` reads its features).
"""

from .backends import BACKENDS, Runtime, backend_key, load_model, resolve_backend, set_backend
from .config import ModelConfig
from .default import default_model_path
from .errors import BackendUnavailable, ModelFileError
from .llama import KVCache, Model

__all__ = [
    "BACKENDS", "BackendUnavailable", "KVCache", "Model", "ModelConfig", "ModelFileError", "Runtime",
    "backend_key", "default_model_path", "load_model", "resolve_backend", "set_backend",
]  # fmt: skip
