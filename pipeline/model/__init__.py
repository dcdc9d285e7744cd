"""The model runtime: GGUF loading, prepared-weight caches, and two backends behind one interface.

- `llama.Model`: the numpy float32 reference (the oracle in tests);
- `fast_llama.FastModel`: the fast, row-invariant runtime users run, with the native products
  (the GGUF's own blocks times int8 activations, `products.c`) or torch's (`fast_products`);
- `backends.load_model`: picks one for this machine (`cpu` reads its features).
A new kernel goes behind `fast_products` (a product strategy) or into the C files built by `native`.
"""

from pipeline.model.backends import BACKENDS, Runtime, backend_key, load_model, resolve_backend, set_backend
from pipeline.model.config import ModelConfig
from pipeline.model.default import default_model_path
from pipeline.model.errors import BackendUnavailable, ModelFileError
from pipeline.model.llama import KVCache, Model

__all__ = [
    "BACKENDS", "BackendUnavailable", "KVCache", "Model", "ModelConfig", "ModelFileError", "Runtime",
    "backend_key", "default_model_path", "load_model", "resolve_backend", "set_backend",
]  # fmt: skip
