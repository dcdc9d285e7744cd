"""The native backend's weights: the GGUF's own blocks, re-laid for `products.c`.

- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices keep their integer values and their
  float16 scales (and the K-quants' 6- or 8-bit sub-block scales) exactly, in tiles of 16
  outputs (the layout and the arithmetic are described at the top of products.c). Those are the
  types a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 download holds.
- Any other type (F32, F16, BF16, other quants) is dequantized and quantized to Q8_0 here: a
  near-exact form, named in the model's `describe()`; never a silent approximation.

Q/K rows are un-permuted by reordering whole rows (blocks move, values do not change). Q/K/V and
gate/up are fused along the output axis into one part per run of one block type: a product whose
Q and K are Q4_K and whose V is Q6_K is two parts, each multiplied on its own (layers.c). An
output count that is not a multiple of 16 is padded with zero rows whose outputs are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.errors import ModelFileError
from pipeline.model.gguf_file import FAMILIES, _open, _tensor, unpermute_order

GROUP, TILE, SUPER = 32, 16, 256
# products.c's kind for each block type held as it is (its enum)
KINDS = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 1, "Q5_0": 2, "Q5_1": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
EXACT_KINDS = tuple(KINDS)
SUPER_KINDS = ("Q4_K", "Q5_K", "Q6_K")  # scales per super-block of 256 inputs
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}
# bytes of one block of 32 (per-block types) or of one super-block of 256 (K types) in the file
BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}


class QuantBlocks(NamedTuple):
    """A matrix as the file's blocks, rows = outputs.

    q holds the unsigned integer values u (Q8_0: the signed q, stored as q + 128 when packed);
    the other fields are the file's scales, exactly, per block of 32 or per super-block of 256:
    - Q4_0, Q5_0, Q8_0: d per block;  Q4_1, Q5_1: d and m per block;
    - Q4_K, Q5_K: d and m (the file's dmin) per super-block, sc and mn (0..63) per block;
    - Q6_K: d per super-block, sc (int8) per 16 values.
    """

    kind: str
    q: np.ndarray  # (out, in) uint8 (Q8_0: int8)
    d: np.ndarray  # float16
    m: np.ndarray | None = None  # float16
    sc: np.ndarray | None = None  # uint8 (Q4_K, Q5_K) or int8 (Q6_K)
    mn: np.ndarray | None = None  # uint8

    def rows(self, order: np.ndarray) -> QuantBlocks:
        return QuantBlocks(*(self.kind, *(None if a is None else a[order] for a in self[1:])))


class NativeMatrix(NamedTuple):
    kind: str  # a key of KINDS
    data: np.ndarray  # (tiles, units, bytes per tile-unit) uint8: units are blocks, or K super-blocks
    n_out: int  # the real output count (data may hold padding up to a multiple of 16)
    n_in: int
    exact: bool  # the file's own blocks (False: quantized to Q8_0 here)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _low_high(packed: np.ndarray) -> np.ndarray:
    """Bytes holding values i (low nibble) and i + len (high nibble), as the values in order."""
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1)


def split_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantBlocks:
    """Parse the raw GGUF bytes of a `kind` tensor of (out, in) `shape` (ggml's block layouts)."""
    n_out, n_in = shape
    per = SUPER if kind in SUPER_KINDS else GROUP
    b = np.asarray(raw, dtype=np.uint8).reshape(n_out, n_in // per, BLOCK_BYTES[kind])
    if kind == "Q8_0":
        return QuantBlocks(kind, b[..., 2:].view(np.int8).reshape(n_out, n_in), _f16(b[..., 0:2]))
    if kind in ("Q4_0", "Q4_1"):
        m = _f16(b[..., 2:4]) if kind == "Q4_1" else None
        return QuantBlocks(kind, _low_high(b[..., -16:]).reshape(n_out, n_in), _f16(b[..., 0:2]), m)
    if kind in ("Q5_0", "Q5_1"):
        at = 4 if kind == "Q5_1" else 2
        high = np.unpackbits(b[..., at : at + 4], axis=-1, bitorder="little")  # bit i: value i's fifth bit
        q = _low_high(b[..., -16:]) | (high << 4)
        m = _f16(b[..., 2:4]) if kind == "Q5_1" else None
        return QuantBlocks(kind, q.reshape(n_out, n_in), _f16(b[..., 0:2]), m)
    if kind in ("Q4_K", "Q5_K"):
        import gguf

        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        qs = b[..., -128:].reshape(n_out, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n_out, -1, 8, 32)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(n_out, -1, 1, 32)  # bit s of byte l: value l of sub-block s
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
        return QuantBlocks(
            kind, q.reshape(n_out, n_in), d, dmin, sc.reshape(n_out, -1), mn.reshape(n_out, -1)
        )
    if kind == "Q6_K":
        ql = b[..., :128].reshape(n_out, -1, 2, 64)  # two halves of 128 values
        qh = b[..., 128:192].reshape(n_out, -1, 2, 1, 32)
        low = np.concatenate([ql & 0xF, ql >> 4], axis=-1).reshape(n_out, -1, 2, 4, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        q = (low | (high << 4)).reshape(n_out, n_in)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n_out, -1)
        return QuantBlocks(kind, q, _f16(b[..., 208:210]), sc=sc)
    raise ModelFileError(f"block type {kind} is not held natively")


def quantize_q8_0(w: np.ndarray) -> QuantBlocks:
    return quantize_blocks(w, "Q8_0")


def quantize_blocks(w: np.ndarray, kind: str) -> QuantBlocks:
    """float32 rows as ggml's `kind` blocks (gguf-py's reference quantizer), parsed as the file's."""
    import gguf

    raw = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[kind])
    return split_blocks(raw, kind, w.shape)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def _values(blocks: QuantBlocks, tiles: int) -> np.ndarray:
    """Each block's values in products.c's groups: (tiles, blocks, value bytes)."""
    nb = blocks.q.shape[1] // GROUP
    q = _pad_rows(blocks.q, tiles * TILE)
    if blocks.kind == "Q8_0":  # as unsigned bytes q + 128: one integer product serves every kind
        u = (q.view(np.uint8) ^ np.uint8(0x80)).reshape(tiles, TILE, nb, 8, 4)
        return u.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 512)
    groups = q.reshape(tiles, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # (tile, block, group, column, j)
    low = groups & 0xF
    parts = [(low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(tiles, nb, 256)]
    bits = BITS[blocks.kind]
    if bits == 5:  # bit g of the plane's byte: the fifth bit of group g's byte
        fifth = ((groups >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1, 1)
        parts.append(np.bitwise_or.reduce(fifth, axis=2).reshape(tiles, nb, 64))
    elif bits == 6:  # bits 2j, 2j + 1 of plane h: bits 4 and 5 of group 4h + j's byte
        top = ((groups >> 4) & 3).reshape(tiles, nb, 2, 4, TILE, 4)
        top = top << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)
        parts.append(np.bitwise_or.reduce(top, axis=3).reshape(tiles, nb, 128))
    return np.concatenate(parts, axis=-1).astype(np.uint8)


def _per_tile(a: np.ndarray, tiles: int) -> np.ndarray:
    """(out, units, k...) scales as (tiles, units, k..., 16 columns) bytes."""
    a = _pad_rows(a, tiles * TILE)
    a = a.reshape(tiles, TILE, *a.shape[1:])
    return np.moveaxis(a, 1, -1).copy().view(np.uint8).reshape(tiles, a.shape[2], -1)


def pack(blocks: QuantBlocks, exact: bool = True) -> NativeMatrix:
    """Re-lay blocks into products.c's tiles: per (tile, unit) the values, then the scales."""
    n_out, n_in = blocks.q.shape
    tiles = -(-n_out // TILE)
    values = _values(blocks, tiles)
    kind = blocks.kind
    if kind in SUPER_KINDS:
        units = n_in // SUPER
        values = values.reshape(tiles, units, -1)
        if kind == "Q6_K":  # sc per 16 values: (out, block, half)
            scales = [_per_tile(blocks.sc.reshape(n_out, units, 8, 2), tiles), _per_tile(blocks.d, tiles)]
        else:
            scales = [_per_tile(blocks.sc.reshape(n_out, units, 8), tiles),
                      _per_tile(blocks.mn.reshape(n_out, units, 8), tiles),
                      _per_tile(blocks.d, tiles), _per_tile(blocks.m, tiles)]  # fmt: skip
    else:
        m = blocks.m
        if kind in ("Q4_0", "Q5_0"):  # w = d (u - 8 or 16) = d u + m with m = -8 d or -16 d: exact in float16
            m = (blocks.d * np.float16(-(1 << (BITS[kind] - 1)))).astype(np.float16)
        scales = [_per_tile(h, tiles) for h in (blocks.d, m) if h is not None]
    data = np.ascontiguousarray(np.concatenate([values, *scales], axis=-1))
    return NativeMatrix(kind, data, n_out, n_in, exact)


MATRICES = ("wqkv", "wo", "wgu", "wdown")
# The float32 vectors of a layer: the llama block's two norms and bias (None when absent), then the
# families' own (Gemma 3 / Qwen 3's per-head QK-norm, Gemma 3's post-norms), absent from the layer's
# dict when the family has none.
VECTORS = ("attn_norm", "ffn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_ffw_norm")
FAMILY_TENSORS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
                  "post_ffw_norm": "post_ffw_norm"}  # fmt: skip


def family_vectors(cfg: ModelConfig, read: Any, prefix: str) -> dict[str, np.ndarray]:
    """A layer's QK-norm and post-norm weights (F32 in the files), read by `read(name, length)`."""
    lengths = {"q_norm": cfg.head_dim, "k_norm": cfg.head_dim, "post_attn_norm": cfg.d_model,
               "post_ffw_norm": cfg.d_model}  # fmt: skip
    wanted = [*(("q_norm", "k_norm") if cfg.qk_norm else ()),
              *(("post_attn_norm", "post_ffw_norm") if cfg.post_norms else ())]  # fmt: skip
    return {
        key: np.ascontiguousarray(read(f"{prefix}{FAMILY_TENSORS[key]}.weight", lengths[key]), np.float32)
        for key in wanted
    }


Parts = list[tuple[QuantBlocks, bool]]  # a product's weights: (blocks, exact) per run of one kind


class FileBlocks(NamedTuple):
    """Every weight of a file in block form, fused and un-permuted: what both fast backends pack."""

    layers: list[dict[str, Any]]  # VECTORS (f32; bqkv may be None), and MATRICES as Parts
    out_norm: np.ndarray
    head: tuple[QuantBlocks, bool]
    rope_freqs: np.ndarray | None
    requantized: dict[str, str]  # tensor name -> its type in the file, for those held as Q8_0 here

    def exact(self) -> bool:
        """All matrices are the file's own blocks (none was quantized to Q8_0 here)."""
        parts = [part for layer in self.layers for name in MATRICES for part in layer[name]]
        return self.head[1] and all(exact for _, exact in parts)


def fuse(blocks: list[QuantBlocks]) -> QuantBlocks:
    """Blocks of one kind side by side along the outputs."""
    fields = zip(*(b[1:] for b in blocks), strict=True)
    return QuantBlocks(blocks[0].kind, *(None if f[0] is None else np.concatenate(f) for f in fields))


def fuse_runs(got: Parts) -> Parts:
    """Consecutive tensors of one kind become one part: fewer, larger products."""
    runs: Parts = []
    for blocks, exact in got:
        if runs and runs[-1][0].kind == blocks.kind:
            runs[-1] = (fuse([runs[-1][0], blocks]), runs[-1][1] and exact)
        else:
            runs.append((blocks, exact))
    return runs


def read_file_blocks(path: Path, cfg: ModelConfig) -> FileBlocks:
    # 65 lines, over the 60-line limit: one pass over the file's tensors, each name handled in place,
    # reads better than the same pass split across helpers that would share its locals.
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    permuted = FAMILIES[cfg.architecture].permuted
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim
    requantized: dict[str, str] = {}

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
        exact = kind in EXACT_KINDS and n_in % (SUPER if kind in SUPER_KINDS else GROUP) == 0
        blocks = split_blocks(tensor.data, kind, shape) if exact else quantize_q8_0(f32(name, *shape))
        if not exact:
            requantized[name] = kind
        if heads and permuted:
            blocks = blocks.rows(unpermute_order(n_out, heads))
        return blocks, exact

    def matrix(parts: list[tuple[str, int, int | None]], n_in: int) -> Parts:
        """Tensors fused along the output axis, one part per run of one kind."""
        return fuse_runs([blocks_of(name, rows, n_in, heads) for name, rows, heads in parts])

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
            **family_vectors(cfg, f32, p),
        })  # fmt: skip
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    (head,) = matrix([(head_name, cfg.vocab_size, None)], d)
    rope = np.array(f32("rope_freqs.weight", cfg.head_dim // 2)) if cfg.rope_freq_factors else None
    return FileBlocks(layers, np.array(f32("output_norm.weight", d)), head, rope, requantized)


def dequantize(blocks: QuantBlocks) -> np.ndarray:
    """The weights as float32, each the exact value of the header's formula rounded once (as
    gguf-py's dequantization gives them)."""
    kind, n_out = blocks.kind, blocks.q.shape[0]

    def per(a: np.ndarray, width: int) -> np.ndarray:
        return np.repeat(a.astype(np.float64), width, axis=1)

    u = blocks.q.astype(np.float64)
    if kind == "Q8_0":
        w = per(blocks.d, GROUP) * u
    elif kind in ("Q4_0", "Q5_0"):
        w = per(blocks.d, GROUP) * (u - (1 << (BITS[kind] - 1)))
    elif kind in ("Q4_1", "Q5_1"):
        w = per(blocks.d, GROUP) * u + per(blocks.m, GROUP)
    elif kind == "Q6_K":
        scale = per(blocks.d, SUPER) * per(blocks.sc, 16)
        w = scale * (u - 32)
    else:  # Q4_K, Q5_K
        a = per(blocks.d, SUPER) * per(blocks.sc, GROUP)
        w = a * u - per(blocks.m, SUPER) * per(blocks.mn, GROUP)
    return w.astype(np.float32).reshape(n_out, -1)
