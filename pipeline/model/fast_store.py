"""Loads the fast backends, with their prepared weights cached per (model content, backend, format).

Re-laying a GGUF's blocks takes seconds; the result is saved once in the cache (`store.form_directory`:
keyed by the file's content hash) and memory-mapped back, so a warm start costs milliseconds and
processes serving the same file share its pages. Neither backend needs the float32 reference:
config, tokenizer and embedding rows come from the front form (`store.load_front`).
- native: one .npy per array, loaded with `np.load(mmap_mode="r")`; torch is never imported.
- torch: one `torch.save` file, loaded with `torch.load(mmap=True)`; its key holds the torch
  version, because torch's int4 packing is a torch-internal layout.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model.errors import BackendUnavailable
from pipeline.model.fast_llama import FastModel
from pipeline.model.fast_products import NativeProducts
from pipeline.model.native import row_kernels
from pipeline.model.native_weights import (
    MATRICES,
    VECTORS,
    FileBlocks,
    NativeMatrix,
    Parts,
    pack,
    read_file_blocks,
)
from pipeline.model.sealed import seal_directory, seal_file
from pipeline.model.store import form_directory, intact, intact_file, load_front, publish

# 3: Q8_0 values stored as q + 128; 4: K-quant and Q5 blocks, products in parts; 5: sealed;
# 6: the families' QK-norm and post-norm vectors (Gemma 3, Qwen 3)
FORMAT_VERSION = 6
FORMATS = {"native": ("q8",), "torch": ("int4", "bf16")}


def _native_arrays(blocks: FileBlocks) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays: dict[str, np.ndarray] = {"out_norm": blocks.out_norm}
    meta: dict[str, Any] = {"exact": blocks.exact(), "matrices": {}, "requantized": blocks.requantized}
    if blocks.rope_freqs is not None:
        arrays["rope_freqs"] = blocks.rope_freqs

    def put(key: str, parts: Parts) -> None:
        meta["matrices"][key] = []
        for index, quant in enumerate(parts):
            matrix = pack(*quant)
            arrays[f"{key}.{index}"] = matrix.data
            meta["matrices"][key].append([matrix.kind, matrix.n_out, matrix.n_in, matrix.exact])

    for i, layer in enumerate(blocks.layers):
        for name in VECTORS:
            if layer.get(name) is not None:
                arrays[f"{i}.{name}"] = layer[name]
        for name in MATRICES:
            put(f"{i}.{name}", layer[name])
    put("head", [blocks.head])
    return arrays, meta


def stored_arrays(
    directory: Path, build: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays kept at `directory` in the weight cache (one .npy each and a manifest, sealed),
    memory-mapped, and the manifest. `build()` makes them, with the manifest's other entries, when
    the directory is missing or damaged; a concurrent builder's copy is as good."""
    if not intact(directory):
        arrays, meta = build()
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        for key, array in arrays.items():
            np.save(staging / f"{key}.npy", np.ascontiguousarray(array))
        (staging / "manifest.json").write_text(json.dumps({**meta, "arrays": sorted(arrays)}))
        seal_directory(staging)
        publish(staging, directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    return {key: np.load(directory / f"{key}.npy", mmap_mode="r") for key in manifest["arrays"]}, manifest


def load_native(path: Path) -> FastModel:
    cfg, embed, tokenizer = load_front(path)
    directory = form_directory(path, f"native-v{FORMAT_VERSION}")
    arrays, manifest = stored_arrays(directory, lambda: _native_arrays(read_file_blocks(path, cfg)))

    def matrix(key: str) -> list[NativeMatrix]:
        return [NativeMatrix(kind, arrays[f"{key}.{index}"], n_out, n_in, exact)
                for index, (kind, n_out, n_in, exact) in enumerate(manifest["matrices"][key])]  # fmt: skip

    layers = [
        {"bqkv": None, **{n: np.asarray(arrays[f"{i}.{n}"]) for n in VECTORS if f"{i}.{n}" in arrays},
         **{name: matrix(f"{i}.{name}") for name in MATRICES}}
        for i in range(cfg.n_layers)
    ]  # fmt: skip
    (head,) = matrix("head")
    parts = [part for layer in layers for n in MATRICES for part in layer[n]]
    kinds = sorted({m.kind for m in parts})
    step_bytes = sum(int(m.data.nbytes) for m in parts) + int(head.data.nbytes)
    description = (
        f"native q8: layer weights {'/'.join(kinds)} ({requantized_note(manifest['requantized'])}), head "
        f"{head.kind}, activations int8 per 32 into every product with exact integer sums, "
        f"f32 residual/norm/RoPE/attention, f16 KV; {'AVX512-VNNI' if vnni() else 'portable C'} products"
    )
    return FastModel(
        cfg, layers, np.asarray(arrays["out_norm"]), head,
        np.asarray(arrays["rope_freqs"]) if "rope_freqs" in arrays else None,
        embed, tokenizer, NativeProducts(row_kernels()), "q8", description, step_bytes,
    )  # fmt: skip


def requantized_note(requantized: dict[str, str]) -> str:
    """What describe() says of the matrices not held as the file's own blocks, by their file type."""
    if not requantized:
        return "the file's own blocks"
    counts = Counter(requantized.values())
    listed = ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items()))
    return f"the file's own blocks but {len(requantized)} tensors requantized to Q8_0 here: {listed}"


def vnni() -> bool:
    return bool(row_kernels().has_vnni())


def load_torch(path: Path, weight_format: str) -> FastModel:
    import torch

    from pipeline.model.fast_products import TorchProducts
    from pipeline.model.torch_weights import can_pack_int4, torch_matrix

    if weight_format == "int4" and not can_pack_int4():
        raise BackendUnavailable(f"torch {torch.__version__} has no CPU int4 kernels (use torch:bf16)")
    cfg, embed, tokenizer = load_front(path)
    version = torch.__version__.split("+")[0]
    target = form_directory(path, f"torch-{weight_format}-v{FORMAT_VERSION}-torch{version}.pt")
    if not intact_file(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        blocks = read_file_blocks(path, cfg)
        flat: dict[str, Any] = {
            "out_norm": blocks.out_norm,
            "head": pack(*blocks.head),
            "rope": blocks.rope_freqs,
        }
        flat["layers"] = [
            {**{n: layer[n] for n in VECTORS if n in layer},
             **{n: torch_matrix(layer[n], weight_format) for n in MATRICES}}
            for layer in blocks.layers
        ]  # fmt: skip
        fd, staging = tempfile.mkstemp(prefix=".pack-", suffix=".pt", dir=target.parent)
        os.close(fd)
        torch.save(flat, staging)
        publish(Path(staging), target)
        seal_file(target)
    flat = torch.load(target, mmap=True, weights_only=False)
    layers = flat["layers"]
    step_bytes = int(flat["head"].data.nbytes) + sum(
        sum(t.numel() * t.element_size() for t in (m if isinstance(m, tuple) else (m,)))
        for layer in layers for m in (layer[n] for n in MATRICES)
    )  # fmt: skip
    description = (
        f"torch {torch.__version__} {weight_format}: layer weights "
        f"{'int4 g32 with bf16 scale/zero' if weight_format == 'int4' else 'bf16'}, bf16 activations into "
        f"the layer products, native Q8_0 head on int8 activations, f32 residual/norm/RoPE/attention, f16 KV"
    )
    return FastModel(
        cfg, layers, flat["out_norm"], flat["head"], flat["rope"], embed, tokenizer,
        TorchProducts(), weight_format, description, step_bytes,
    )  # fmt: skip


def load_fast(path: Path, backend: str, weight_format: str | None) -> FastModel:
    formats = FORMATS[backend]
    chosen = weight_format or formats[0]
    if chosen not in formats:
        raise BackendUnavailable(
            f"the {backend} backend has no weight format {chosen!r} (it has {', '.join(formats)})"
        )
    return load_native(path) if backend == "native" else load_torch(path, chosen)
