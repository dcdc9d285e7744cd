"""The torch backend's prepared-weight cache: one file per (model content, weight format, layout).

Packing a GGUF into torch's int4 layout takes seconds; the packed tensors are saved once with
`torch.save` and memory-mapped back (`torch.load(mmap=True)`), so a warm start costs
milliseconds and processes serving the same file share its pages. The key holds the file's
content hash, the weight format, this module's format version and the torch version, since
torch's int4 packing is a torch-internal layout. The tokenizer, config and embedding rows come
from the reference backend's cache (`store.load_prepared`), which both backends share.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from .cpu import choose_format
from .errors import ModelFileError
from .store import cache_directory, load_prepared
from .torch_llama import TorchModel
from .torch_weights import Int4Matrix, TorchWeights, can_pack_int4, read_torch_weights

FORMAT_VERSION = 1
WEIGHT_FORMATS = ("int4", "bf16")
MATRICES = ("wqkv", "wo", "wgu", "wdown")


def _flatten(w: TorchWeights) -> dict[str, object]:
    flat: dict[str, object] = {
        "out_norm": w.out_norm, "head_q": torch.from_numpy(w.head_q),
        "head_scale": torch.from_numpy(w.head_scale), "head_exact": w.head_exact,
    }  # fmt: skip
    if w.rope_freqs is not None:
        flat["rope_freqs"] = torch.from_numpy(w.rope_freqs)
    for i, layer in enumerate(w.layers):
        for name, value in layer.items():
            if isinstance(value, Int4Matrix):
                flat[f"{i}.{name}.packed"], flat[f"{i}.{name}.scale_zero"] = value.packed, value.scale_zero
            elif value is not None:
                flat[f"{i}.{name}"] = value
    return flat


def _unflatten(flat: dict[str, object], n_layers: int) -> TorchWeights:
    def get(key: str) -> object:
        if f"{key}.packed" in flat:
            return Int4Matrix(flat[f"{key}.packed"], flat[f"{key}.scale_zero"])  # type: ignore[arg-type]
        return flat.get(key)

    layers = [
        {name: get(f"{i}.{name}") for name in ("attn_norm", "ffn_norm", "bqkv", *MATRICES)}
        for i in range(n_layers)
    ]
    rope = flat.get("rope_freqs")
    return TorchWeights(
        layers, flat["out_norm"], flat["head_q"].numpy(), flat["head_scale"].numpy(),  # type: ignore[union-attr]
        bool(flat["head_exact"]), rope.numpy() if rope is not None else None,  # type: ignore[union-attr]
    )  # fmt: skip


def resolve_format(weight_format: str | None) -> str:
    chosen = weight_format or choose_format()
    if chosen not in WEIGHT_FORMATS:
        raise ModelFileError(f"unknown weight format {chosen!r} (known: {', '.join(WEIGHT_FORMATS)})")
    if chosen == "int4" and not can_pack_int4():
        return "bf16"
    return chosen


def load_torch_prepared(path: Path, weight_format: str | None = None) -> TorchModel:
    """The torch backend for `path`, packed now and cached if this combination is new."""
    cfg, reference_weights, tokenizer = load_prepared(path)
    fmt = resolve_format(weight_format)
    version = torch.__version__.split("+")[0]
    target = cache_directory(path) / f"torch-{fmt}-v{FORMAT_VERSION}-torch{version}.pt"
    if not target.is_file():
        flat = _flatten(read_torch_weights(path, cfg, fmt))
        fd, staging = tempfile.mkstemp(prefix=".pack-", suffix=".pt", dir=target.parent)
        os.close(fd)
        try:
            torch.save(flat, staging)
            os.replace(staging, target)  # atomic: a concurrent loader sees the whole file or none
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
    flat = torch.load(target, mmap=True, weights_only=True)
    weights = _unflatten(flat, cfg.n_layers)
    return TorchModel(cfg, weights, np.asarray(reference_weights["embed"]), tokenizer, fmt)
