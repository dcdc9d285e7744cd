"""The on-disk cache of prepared weights, keyed by the model file's content hash.

Preparing a GGUF (parse, dequantize, fuse) takes seconds and ~1.6 GB of RAM; loading
the prepared arrays back with `np.load(mmap_mode="r")` takes milliseconds and lets
every process that serves the same file share the same page-cache pages.

Two forms live here, each in its own directory:
- the reference (`load_prepared`): every weight as float32, what the numpy runtime computes
  with: four times a 4-bit file's size, so only the numpy backend and the tests ask for it;
- the front (`load_front`): config, tokenizer and the embedding rows, what the orchestrator and
  the fast backends need beside their own weight forms (`fast_store`), made without
  dequantizing any other tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.gguf_file import (
    PreparedWeights,
    _open,
    _tensor,
    read_config,
    read_gguf,
    read_tokenizer_metadata,
)
from pipeline.model.sealed import SUFFIX, directory_problem, file_problem, seal_directory
from pipeline.model.tokenizer import Tokenizer

FORMAT_VERSION = 2  # 2: sealed (pipeline/model/sealed.py)
log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("SPECLANES_CACHE") or Path.home() / ".cache" / "speclanes")


def content_hash(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hash_memo(path: Path) -> str:
    """The content hash, remembered per (path, size, mtime) so a warm start skips re-reading."""
    st = path.stat()
    memo_dir = cache_root() / "hashes"
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    memo = memo_dir / key
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if is_digest(digest):
            return digest
    digest = content_hash(path)
    memo_dir.mkdir(parents=True, exist_ok=True)
    staging = memo.with_name(memo.name + ".tmp")
    staging.write_text(digest)
    os.replace(staging, memo)
    return digest


def _write(directory: Path, cfg: ModelConfig, weights: PreparedWeights, tokenizer: Tokenizer) -> None:
    for name, array in weights.items():
        np.save(directory / f"{name}.npy", np.ascontiguousarray(array, dtype=np.float32))
    tok_json, info_json = tokenizer.to_json()
    (directory / "tokenizer.json").write_text(tok_json)
    (directory / "tokenizer_info.json").write_text(info_json)
    (directory / "config.json").write_bytes(msgspec.json.encode(cfg))
    (directory / "manifest.json").write_text(
        json.dumps({"format": FORMAT_VERSION, "arrays": sorted(weights)})
    )
    seal_directory(directory)


def _read(directory: Path) -> tuple[ModelConfig, PreparedWeights, Tokenizer]:
    manifest = json.loads((directory / "manifest.json").read_text())
    cfg = msgspec.json.decode((directory / "config.json").read_bytes(), type=ModelConfig)
    weights = {name: np.load(directory / f"{name}.npy", mmap_mode="r") for name in manifest["arrays"]}
    tokenizer = Tokenizer.from_json(
        (directory / "tokenizer.json").read_text(), (directory / "tokenizer_info.json").read_text()
    )
    return cfg, weights, tokenizer


def cache_directory(path: Path) -> Path:
    """Where the reference form of the model file at `path` lives, keyed by its content."""
    return form_directory(path, f"v{FORMAT_VERSION}")


def form_directory(path: Path, form: str) -> Path:
    """Where one prepared form (the reference, the front, a backend's) of the file at `path` lives."""
    path = Path(path)
    return cache_root() / f"{_hash_memo(path) if path.is_file() else 'missing'}-{form}"


def intact(directory: Path) -> bool:
    """Whether a cached form is there and matches its seal. A damaged one is removed, with one
    warning, so that the caller rebuilds it from the model file."""
    if not directory.exists():
        return False
    problem = directory_problem(directory)
    if problem is None:
        return True
    log.warning(
        "speclanes: cache entry %s is damaged (%s): rebuilding it from the model file", directory, problem
    )
    shutil.rmtree(directory, ignore_errors=True)
    return False


def intact_file(path: Path) -> bool:
    """`intact` for a single cached file (sealed beside it)."""
    if not path.exists():
        return False
    problem = file_problem(path)
    if problem is None:
        return True
    log.warning("speclanes: cache entry %s is damaged (%s): rebuilding it", path, problem)
    for stale in (path, path.with_name(path.name + SUFFIX)):
        with contextlib.suppress(OSError):
            stale.unlink()
    return False


def publish(staging: Path, target: Path) -> None:
    """Move a fully written staging path (a directory or a file) into place; a concurrent writer's
    copy is as good."""
    with contextlib.suppress(OSError):  # a directory onto an existing one fails: the other copy stays
        os.replace(staging, target)
    if staging.is_dir():
        shutil.rmtree(staging, ignore_errors=True)
    elif staging.exists():
        staging.unlink()


def is_digest(text: str) -> bool:
    """A content hash as the memo keeps it (a damaged memo is hashed again, never trusted)."""
    return re.fullmatch(r"[0-9a-f]{64}", text) is not None


class Front(NamedTuple):
    """A model file's front: what every process but a model lane needs of it."""

    cfg: ModelConfig
    embed: np.ndarray  # (vocab, d) float32, memory-mapped
    tokenizer: Tokenizer


def load_front(path: Path) -> Front:
    """Config, float32 embedding rows (memory-mapped) and tokenizer of the file at `path`: from the
    reference when it is prepared already, else from the front form, prepared now if need be."""
    path = Path(path)
    reference = cache_directory(path)
    if intact(reference):
        cfg, weights, tokenizer = _read(reference)
        return Front(cfg, weights["embed"], tokenizer)
    directory = form_directory(path, f"front-v{FORMAT_VERSION}")
    if not intact(directory):
        reader = _open(path)
        cfg = read_config(reader)
        tensors = {t.name: t for t in reader.tensors}
        embed = _tensor(reader, tensors, "token_embd.weight", (cfg.vocab_size, cfg.d_model))
        tokenizer = Tokenizer.from_metadata(read_tokenizer_metadata(reader))
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".front-", dir=directory.parent))
        try:
            _write(staging, cfg, {"embed": embed}, tokenizer)
            publish(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    cfg, weights, tokenizer = _read(directory)
    return Front(cfg, weights["embed"], tokenizer)


def load_prepared(path: Path) -> tuple[ModelConfig, PreparedWeights, Tokenizer]:
    """Prepared weights for `path`, from the cache or prepared now and cached.

    The directory is filled under a temporary name and renamed into place, so a
    reader never sees half a cache and two processes preparing at once both win.
    """
    directory = cache_directory(path)
    if intact(directory):
        return _read(directory)
    cfg, weights, meta = read_gguf(path)
    tokenizer = Tokenizer.from_metadata(meta)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=directory.parent))
    try:
        _write(staging, cfg, weights, tokenizer)
        publish(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _read(directory)
