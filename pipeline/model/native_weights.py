"""The native backend's weights: the GGUF's own 4- and 8-bit blocks, re-laid for `products.c`.

- Q4_0 and Q4_1 matrices keep their 4-bit values and float16 d (and m) exactly, in tiles of
  16 outputs x 32 inputs (the layout is described at the top of products.c).
- Q8_0 matrices, the tied LM head among them, keep their int8 values (stored as the unsigned
  bytes q + 128) and float16 d exactly.
- Any other type (F32, F16, BF16, K-quants) is dequantized and quantized to Q8_0 here: a
  near-exact form, named in the model's `describe()`; never a silent approximation.

Q/K rows are un-permuted by reordering whole rows (blocks move, values do not change); Q/K/V
and gate/up are fused along the output axis. An output count that is not a multiple of 16 is
padded with zero rows whose outputs are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.errors import ModelFileError
from pipeline.model.gguf_file import SUPPORTED_ARCHITECTURES, _open, _tensor, unpermute_order

GROUP, TILE = 32, 16
EXACT_KINDS = ("Q4_0", "Q4_1", "Q8_0")


class QuantBlocks(NamedTuple):
    """A matrix as the file's blocks: values, float16 d, and (Q4_1) float16 m, rows = outputs."""

    kind: str  # Q4_0 | Q4_1 | Q8_0
    q: np.ndarray  # (out, in): uint8 0..15 for Q4, int8 for Q8
    d: np.ndarray  # (out, in / 32) float16
    m: np.ndarray | None  # (out, in / 32) float16, Q4_1 only

    def rows(self, order: np.ndarray) -> QuantBlocks:
        return QuantBlocks(self.kind, self.q[order], self.d[order], None if self.m is None else self.m[order])


class NativeMatrix(NamedTuple):
    kind: str  # Q4_0 | Q4_1 | Q8_0
    data: np.ndarray  # (tiles, in / 32, bytes per tile-block) uint8
    n_out: int  # the real output count (data may hold padding up to a multiple of 16)
    n_in: int
    exact: bool  # the file's own blocks (False: quantized to Q8_0 here)


def split_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantBlocks:
    """Parse raw GGUF bytes of a Q4_0/Q4_1/Q8_0 tensor of (out, in) `shape`."""
    n_out, n_in = shape
    width = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n_out, n_in // GROUP, width)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if kind == "Q8_0":
        return QuantBlocks(kind, blocks[..., 2:].view(np.int8).reshape(n_out, n_in), d, None)
    packed = blocks[..., width - 16 :]
    q = np.concatenate([packed & 0xF, packed >> 4], axis=-1).reshape(n_out, n_in)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if kind == "Q4_1" else None
    return QuantBlocks(kind, q, d, m)


def quantize_q8_0(w: np.ndarray) -> QuantBlocks:
    import gguf

    raw = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    return split_blocks(raw, "Q8_0", w.shape)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def pack(blocks: QuantBlocks, exact: bool = True) -> NativeMatrix:
    """Re-lay blocks into products.c's tiles: per (tile, block) the values, then d (and m)."""
    n_out, n_in = blocks.q.shape
    padded = -(-n_out // TILE) * TILE
    tiles, nb = padded // TILE, n_in // GROUP
    q = _pad_rows(blocks.q, padded)
    m = blocks.m
    if blocks.kind == "Q4_0":  # w = d (q - 8) = d q + m with m = -8 d, exact in float16
        m = (blocks.d * np.float16(-8)).astype(np.float16)
    halves = [_pad_rows(h, padded) for h in (blocks.d, m) if h is not None]
    if blocks.kind == "Q8_0":  # as unsigned bytes q + 128: products.c's one integer product serves both kinds
        unsigned = q.view(np.uint8) ^ np.uint8(0x80)
        values = unsigned.reshape(tiles, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 512)
    else:
        nib = q.reshape(tiles, TILE, nb, 4, 2, 4)  # (tile, column, block, part, low/high, j)
        values = (nib[..., 0, :] | (nib[..., 1, :] << 4)).astype(np.uint8)
        values = values.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 256)
    scales = [h.reshape(tiles, TILE, nb).transpose(0, 2, 1).copy().view(np.uint8) for h in halves]
    data = np.ascontiguousarray(np.concatenate([values, *scales], axis=-1))
    return NativeMatrix(blocks.kind, data, n_out, n_in, exact)


MATRICES = ("wqkv", "wo", "wgu", "wdown")


class FileBlocks(NamedTuple):
    """Every weight of a file in block form, fused and un-permuted: what both fast backends pack."""

    layers: list[dict[str, Any]]  # attn_norm, ffn_norm (f32), bqkv (f32 or None), and MATRICES
    out_norm: np.ndarray
    head: tuple[QuantBlocks, bool]
    rope_freqs: np.ndarray | None

    def exact(self) -> bool:
        """All matrices are the file's own blocks (none was quantized to Q8_0 here)."""
        return self.head[1] and all(layer[name][1] for layer in self.layers for name in MATRICES)


def read_file_blocks(path: Path, cfg: ModelConfig) -> FileBlocks:
    # 64 lines, over the 60-line limit: one pass over the file's tensors, each name handled in place,
    # reads better than the same pass split across helpers that would share its locals.
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    permuted = SUPPORTED_ARCHITECTURES[cfg.architecture]["permuted"]
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim

    def f32(name: str, *shape: int) -> np.ndarray:
        return _tensor(reader, tensors, name, tuple(shape))

    def blocks_of(name: str, n_out: int, n_in: int, heads: int | None) -> tuple[QuantBlocks, bool]:
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelFileError(f"tensor {name!r} is missing")
        shape = (n_out, n_in)
        got = tuple(int(n) for n in tensor.shape[::-1])
        if got != shape:
            raise ModelFileError(f"tensor {name!r} has shape {got}, expected {shape}")
        kind = tensor.tensor_type.name
        exact = kind in EXACT_KINDS and n_in % GROUP == 0
        blocks = split_blocks(tensor.data, kind, shape) if exact else quantize_q8_0(f32(name, *shape))
        if heads and permuted:
            blocks = blocks.rows(unpermute_order(n_out, heads))
        return blocks, exact

    def matrix(parts: list[tuple[str, int, int | None]], n_in: int) -> tuple[QuantBlocks, bool]:
        """Parts fused along the output axis; all must share one kind, else all become Q8_0."""
        got = [blocks_of(name, rows, n_in, heads) for name, rows, heads in parts]
        kinds = {b.kind for b, _ in got}
        if len(kinds) > 1:
            got = [(quantize_q8_0(dequantize(b)), False) for b, _ in got]
        fused = QuantBlocks(
            got[0][0].kind,
            np.concatenate([b.q for b, _ in got]),
            np.concatenate([b.d for b, _ in got]),
            None if got[0][0].m is None else np.concatenate([b.m for b, _ in got]),
        )
        return fused, all(exact for _, exact in got)

    if d % GROUP or f % GROUP or q % GROUP:
        raise ModelFileError(f"the native backend needs widths that are multiples of {GROUP}")
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        bias = None
        if cfg.qkv_bias:
            bq, bk, bv = f32(p + "attn_q.bias", q), f32(p + "attn_k.bias", kv), f32(p + "attn_v.bias", kv)
            if permuted:
                bq, bk = bq[unpermute_order(q, cfg.n_heads)], bk[unpermute_order(kv, cfg.n_kv_heads)]
            bias = np.ascontiguousarray(np.concatenate([bq, bk, bv]), dtype=np.float32)
        qkv_parts = [(p + "attn_q.weight", q, cfg.n_heads), (p + "attn_k.weight", kv, cfg.n_kv_heads),
                     (p + "attn_v.weight", kv, None)]  # fmt: skip
        layers.append({
            "attn_norm": np.array(f32(p + "attn_norm.weight", d)),
            "ffn_norm": np.array(f32(p + "ffn_norm.weight", d)),
            "bqkv": bias,
            "wqkv": matrix(qkv_parts, d),
            "wo": matrix([(p + "attn_output.weight", d, None)], q),
            "wgu": matrix([(p + "ffn_gate.weight", f, None), (p + "ffn_up.weight", f, None)], d),
            "wdown": matrix([(p + "ffn_down.weight", d, None)], f),
        })  # fmt: skip
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    head = matrix([(head_name, cfg.vocab_size, None)], d)
    rope = np.array(f32("rope_freqs.weight", cfg.head_dim // 2)) if cfg.rope_freq_factors else None
    return FileBlocks(layers, np.array(f32("output_norm.weight", d)), head, rope)


def dequantize(blocks: QuantBlocks) -> np.ndarray:
    d = np.repeat(blocks.d.astype(np.float32), GROUP, axis=1)
    if blocks.kind == "Q8_0":
        return d * blocks.q.astype(np.float32)
    if blocks.kind == "Q4_0":
        return d * (blocks.q.astype(np.float32) - 8)
    return d * blocks.q.astype(np.float32) + np.repeat(blocks.m.astype(np.float32), GROUP, axis=1)
