"""The model runtime: GGUF loading, prepared-weight cache, numpy forward pass."""

from .config import ModelConfig
from .default import default_model_path
from .errors import ModelFileError
from .llama import KVCache, Model

__all__ = ["KVCache", "Model", "ModelConfig", "ModelFileError", "default_model_path"]
