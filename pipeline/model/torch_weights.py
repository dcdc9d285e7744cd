"""The torch backend's weights, taken from the GGUF's own blocks where a kernel holds them as they are.

- Q4_0 and Q4_1 matrices become torch's int4 group-32 layout (`_weight_int4pack_mm_for_cpu`):
  w = (q - 8) * scale + zero, so Q4_1's (d, m, q) is scale = d, zero = m + 8d and Q4_0's is
  scale = d, zero = 0. The 4-bit values are kept exactly; scale and zero are rounded from the
  file's float16 to bfloat16, the only form the fast kernel takes.
- Every other matrix type is dequantized and held as bfloat16 (`F.linear`): one clear path,
  chosen per matrix at load time, never per forward, so a position's numbers cannot depend on
  how many rows a forward carries.
- The LM head (the tied embedding here) stays Q8_0, int8 values and a float32 scale per 32,
  exactly the file's numbers, and is applied to float32 activations by `head_q8_0` with float32
  logits out (a bfloat16 product would round logits of 20 to steps of 0.125). A head of any other
  type is quantized to Q8_0 at load time: a near-exact form, stated in `weight_format`.
- Norms stay float32 and unfolded, because folding them would change the 4-bit weights.

Q/K rows are un-permuted (llama.cpp interleaves rotary pairs) by reordering whole rows, which
moves blocks without touching a value. Q/K/V and gate/up are fused along the output axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .config import ModelConfig
from .errors import ModelFileError
from .gguf_file import SUPPORTED_ARCHITECTURES, _open, _tensor

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1")


class Int4Matrix(NamedTuple):
    packed: torch.Tensor  # torch's CPU int4 packing of (out, in) values 0..15
    scale_zero: torch.Tensor  # (in / 32, out, 2) bfloat16


Matrix = Int4Matrix | torch.Tensor  # a tensor is a bfloat16 (out, in) matrix


class Blocks(NamedTuple):
    """A 4-bit matrix as the file holds it: values 0..15, and per 32-block scale and zero."""

    q: np.ndarray  # (out, in) uint8
    scale: np.ndarray  # (out, in / 32) float32 (exact float16 values)
    zero: np.ndarray  # (out, in / 32) float32

    def rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.q[order], self.scale[order], self.zero[order])


def read_blocks(tensor: Any, shape: tuple[int, int]) -> Blocks | None:
    """The int4 form of a Q4_0/Q4_1 tensor of (out, in) `shape`, or None for any other type."""
    if tensor is None:
        return None  # the dense path reports the missing tensor
    kind = tensor.tensor_type.name
    n_out, n_in = shape
    if tuple(int(n) for n in tensor.shape[::-1]) != shape:
        got = tuple(int(n) for n in tensor.shape[::-1])
        raise ModelFileError(f"tensor {tensor.name!r} has shape {got}, expected {shape}")
    if kind not in INT4_TYPES or n_in % GROUP:
        return None
    width = 18 if kind == "Q4_0" else 20
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n_out, n_in // GROUP, width)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = raw[..., width - 16 :]
    q = np.concatenate([packed & 0xF, packed >> 4], axis=-1).reshape(n_out, n_in)
    if kind == "Q4_0":
        return Blocks(q, d, np.zeros_like(d))
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks(q, d, m + 8 * d)


def pack_int4(blocks: Blocks) -> Int4Matrix:
    q = torch.from_numpy(blocks.q.astype(np.int32))
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scale_zero = torch.from_numpy(np.stack([blocks.scale, blocks.zero], axis=-1).swapaxes(0, 1))
    return Int4Matrix(packed, scale_zero.to(torch.bfloat16).contiguous())


def unpermute_order(n_out: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rotary interleaving (gguf_file._unpermute, as an index)."""
    head_dim = n_out // n_heads
    return np.arange(n_out).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(n_out)


def can_pack_int4() -> bool:
    """Whether this torch has the CPU int4 kernels (2.5 and later do)."""
    return all(
        hasattr(torch, f) for f in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    )


class TorchWeights(NamedTuple):
    layers: list[dict[str, Any]]  # per layer: attn_norm, ffn_norm, wqkv, bqkv (or None), wo, wgu, wdown
    out_norm: torch.Tensor
    head_q: np.ndarray  # int8 (vocab, d)
    head_scale: np.ndarray  # float32 (vocab, d / 32)
    head_exact: bool  # the file's head is Q8_0 (else it was quantized to Q8_0 here)
    rope_freqs: np.ndarray | None


def read_torch_weights(path: Path, cfg: ModelConfig, weight_format: str) -> TorchWeights:
    """Prepare every tensor from the file; `weight_format` int4 packs what it can, bf16 packs nothing."""
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    permuted = SUPPORTED_ARCHITECTURES[cfg.architecture]["permuted"]
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim

    def f32(name: str, *shape: int) -> np.ndarray:
        return _tensor(reader, tensors, name, tuple(shape))

    def fused(parts: list[tuple[str, int, int | None]]) -> Matrix:
        """Matrices stacked along the output axis; (name, rows, heads to un-permute or None)."""
        orders = [unpermute_order(rows, heads) if heads and permuted else None for _, rows, heads in parts]
        if weight_format == "int4":
            blocks = [read_blocks(tensors.get(name), (rows, d)) for name, rows, _ in parts]
            if all(b is not None for b in blocks):
                ordered = [b if o is None else b.rows(o) for b, o in zip(blocks, orders, strict=True)]
                return pack_int4(Blocks(*(np.concatenate(x) for x in zip(*ordered, strict=True))))
        dense = [f32(name, rows, d) for name, rows, _ in parts]
        dense = [w if o is None else w[o] for w, o in zip(dense, orders, strict=True)]
        return torch.from_numpy(np.concatenate(dense)).to(torch.bfloat16)

    def single(name: str, n_out: int, n_in: int) -> Matrix:
        blocks = read_blocks(tensors.get(name), (n_out, n_in)) if weight_format == "int4" else None
        if blocks is not None:
            return pack_int4(blocks)
        return torch.from_numpy(f32(name, n_out, n_in)).to(torch.bfloat16)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        qkv_parts = [(p + "attn_q.weight", q, cfg.n_heads), (p + "attn_k.weight", kv, cfg.n_kv_heads),
                     (p + "attn_v.weight", kv, None)]  # fmt: skip
        bias = None
        if cfg.qkv_bias:
            bq, bk, bv = f32(p + "attn_q.bias", q), f32(p + "attn_k.bias", kv), f32(p + "attn_v.bias", kv)
            if permuted:
                bq, bk = bq[unpermute_order(q, cfg.n_heads)], bk[unpermute_order(kv, cfg.n_kv_heads)]
            bias = torch.from_numpy(np.ascontiguousarray(np.concatenate([bq, bk, bv])))
        layers.append({
            "attn_norm": torch.tensor(f32(p + "attn_norm.weight", d)),
            "ffn_norm": torch.tensor(f32(p + "ffn_norm.weight", d)),
            "wqkv": fused(qkv_parts),
            "bqkv": bias,
            "wo": single(p + "attn_output.weight", d, q),
            "wgu": fused([(p + "ffn_gate.weight", f, None), (p + "ffn_up.weight", f, None)]),
            "wdown": single(p + "ffn_down.weight", d, f),
        })  # fmt: skip
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    head_q, head_scale, exact = read_q8_0(tensors, head_name, (cfg.vocab_size, d), f32)
    rope = f32("rope_freqs.weight", cfg.head_dim // 2) if cfg.rope_freq_factors else None
    out_norm = torch.tensor(f32("output_norm.weight", d))
    return TorchWeights(layers, out_norm, head_q, head_scale, exact, rope)


def read_q8_0(
    tensors: dict[str, Any], name: str, shape: tuple[int, int], f32: Any
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(int8 values, float32 scales, exact): the file's own Q8_0 blocks, or a Q8_0 quantization of
    the dequantized tensor when the file holds another type."""
    import gguf

    n_out, n_in = shape
    if n_in % GROUP:
        raise ModelFileError(f"tensor {name!r} has rows of {n_in} values, not a multiple of {GROUP}")
    tensor = tensors.get(name)
    exact = tensor is not None and tensor.tensor_type.name == "Q8_0"
    if exact:
        raw = np.asarray(tensor.data)
    else:
        raw = gguf.quants.quantize(f32(name, *shape), gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.view(np.uint8).reshape(n_out, n_in // GROUP, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:].view(np.int8).reshape(n_out, n_in))
    return q, np.ascontiguousarray(scale), exact
