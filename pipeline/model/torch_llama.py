"""The fast backend: torch's int4 weight products around row-invariant C kernels.

A layer is four weight products (torch: `_weight_int4pack_mm_for_cpu` for 4-bit matrices,
`F.linear` in bfloat16 for the rest) and four calls into `rowkernels.c` (norm, RoPE and
attention, SiLU, residual-plus-norm). Every one of them computes a row's values with the same
instructions whatever the other rows are, which `tests/test_row_invariance.py` checks bit for
bit; so a position's logits do not depend on the block size, on the batch or on prefill chunking.

Numbers this target computes: the GGUF's 4-bit weights with bfloat16 group scales, bfloat16
activations into every layer product, float32 residual stream, norms, RoPE, attention and KV
cache, and a float32 LM head over the file's Q8_0 embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..tokenizer import Tokenizer
from .config import ModelConfig
from .llama import Rope, validate_batch
from .native import row_kernels
from .torch_weights import Int4Matrix, Matrix, TorchWeights

BF16 = torch.bfloat16


def product(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """x (rows, in) bfloat16 times a prepared matrix: (rows, out) bfloat16."""
    if isinstance(w, Int4Matrix):
        return torch._weight_int4pack_mm_for_cpu(x, w.packed, 32, w.scale_zero)
    return torch.nn.functional.linear(x, w)


def matrix_bytes(w: Matrix) -> int:
    if isinstance(w, Int4Matrix):
        return w.packed.numel() * w.packed.element_size() + w.scale_zero.numel() * 2
    return w.numel() * w.element_size()


class RowCache:
    """One sequence's keys (transposed: head_dim before position) and values, float32.

    The same contract as the reference's KVCache: `length`, `truncate` for rollback, growth by
    doubling. The arrays are numpy so the C kernels take their addresses directly.
    """

    def __init__(self, cfg: ModelConfig, capacity: int = 256) -> None:
        self.cfg = cfg
        self.length = 0
        self._alloc(max(1, min(capacity, cfg.context_length)))

    def _alloc(self, capacity: int) -> None:
        c = self.cfg
        k = np.zeros((c.n_layers, c.n_kv_heads, c.head_dim, capacity), np.float32)
        v = np.zeros((c.n_layers, c.n_kv_heads, capacity, c.head_dim), np.float32)
        if self.length:
            k[..., : self.length] = self.k[..., : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self.capacity = k, v, capacity

    def reserve(self, length: int) -> None:
        if length > self.cfg.context_length:
            raise ValueError(f"sequence of {length} tokens exceeds the context of {self.cfg.context_length}")
        if length > self.capacity:
            self._alloc(min(self.cfg.context_length, max(length, 2 * self.capacity)))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length


def _ptr(a: Any) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data


class TorchModel:
    """Prepared int4/bf16 weights plus the forward pass; holds no per-sequence state."""

    backend = "torch"

    def __init__(
        self, cfg: ModelConfig, weights: TorchWeights, embed: np.ndarray, tokenizer: Tokenizer | None,
        weight_format: str,
    ) -> None:  # fmt: skip
        self.cfg, self.w, self.tokenizer = cfg, weights, tokenizer
        self.embed = np.asarray(embed)
        self.lib = row_kernels()
        rope = Rope.build(cfg, weights.rope_freqs)
        self.cos, self.sin = np.ascontiguousarray(rope.cos), np.ascontiguousarray(rope.sin)
        self.weight_format = weight_format
        self.step_bytes = self._step_bytes()

    def _step_bytes(self) -> int:
        layer_bytes = sum(
            matrix_bytes(lw[name]) for lw in self.w.layers for name in ("wqkv", "wo", "wgu", "wdown")
        )
        return layer_bytes + int(self.w.head_q.nbytes + self.w.head_scale.nbytes)

    def describe(self) -> str:
        """What this target computes, in one line (bench model, status, audit)."""
        head = "Q8_0" if self.w.head_exact else "Q8_0 (requantized)"
        layers = "int4 g32 with bf16 scale/zero" if self.weight_format == "int4" else "bf16"
        return (
            f"torch {torch.__version__} {self.weight_format}: layer weights {layers}, bf16 activations, "
            f"f32 residual/norm/attention/KV, f32 head over {head}"
        )

    def new_cache(self, capacity: int = 256) -> RowCache:
        return RowCache(self.cfg, capacity)

    def forward(self, cache: RowCache, tokens: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """Logits for `tokens` appended at positions [cache.length, cache.length + T)."""
        return self.forward_batch([(cache, tokens)], all_logits=all_logits)[0]

    @torch.inference_mode()
    def forward_batch(
        self, batch: Sequence[tuple[RowCache, Sequence[int]]], *, all_logits: bool = True
    ) -> list[np.ndarray]:
        """One step for several sequences: (T_i, vocab) logits each, or (1, vocab) if not all_logits."""
        cfg, lib, eps = self.cfg, self.lib, self.cfg.rms_eps
        ids = validate_batch(cfg, batch)
        spans = np.cumsum([0, *(t.size for t in ids)])
        n, d = int(spans[-1]), cfg.d_model
        x = np.ascontiguousarray(self.embed[np.concatenate(ids)], dtype=np.float32)
        h = torch.empty((n, d), dtype=BF16)
        attn = torch.empty((n, cfg.q_dim), dtype=BF16)
        act = torch.empty((n, cfg.d_ff), dtype=BF16)
        qkv_width = cfg.q_dim + 2 * cfg.kv_dim
        scale = float(cfg.head_dim**-0.5)
        layers = self.w.layers
        lib.rms_norm_bf16(x.ctypes.data, n, d, _ptr(layers[0]["attn_norm"]), eps, h.data_ptr())
        for index, lw in enumerate(layers):
            qkv = product(h, lw["wqkv"])
            bias = _ptr(lw["bqkv"]) if lw["bqkv"] is not None else None
            for i, (cache, _) in enumerate(batch):
                rows, start = int(spans[i + 1] - spans[i]), cache.length
                kt, v, cap = cache.k[index], cache.v[index], cache.capacity
                lib.rope_attend_bf16(
                    qkv.data_ptr() + int(spans[i]) * qkv_width * 2, bias, rows, start,
                    self.cos.ctypes.data, self.sin.ctypes.data, kt.ctypes.data, v.ctypes.data, cap,
                    cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale,
                    attn.data_ptr() + int(spans[i]) * cfg.q_dim * 2,
                )  # fmt: skip
            out = product(attn, lw["wo"])
            lib.add_rms_norm_bf16(
                x.ctypes.data, out.data_ptr(), n, d, _ptr(lw["ffn_norm"]), eps, h.data_ptr()
            )
            gate_up = product(h, lw["wgu"])
            lib.silu_mul_bf16(gate_up.data_ptr(), n, cfg.d_ff, act.data_ptr())
            down = product(act, lw["wdown"])
            if index + 1 < len(layers):
                nxt = _ptr(layers[index + 1]["attn_norm"])
                lib.add_rms_norm_bf16(x.ctypes.data, down.data_ptr(), n, d, nxt, eps, h.data_ptr())
            else:
                lib.add_bf16(x.ctypes.data, down.data_ptr(), n * d)
        for (cache, _), t in zip(batch, ids, strict=True):
            cache.length += t.size
        rows = np.arange(n) if all_logits else spans[1:] - 1
        return self._head(x[rows], spans if all_logits else np.arange(len(batch) + 1))

    def _head(self, x: np.ndarray, spans: np.ndarray) -> list[np.ndarray]:
        cfg, lib = self.cfg, self.lib
        rows = x.shape[0]
        hidden = np.ascontiguousarray(x)
        normed = np.empty_like(hidden)
        lib.rms_norm_f32(
            hidden.ctypes.data, rows, cfg.d_model, _ptr(self.w.out_norm), cfg.rms_eps, normed.ctypes.data
        )
        logits = np.empty((rows, cfg.vocab_size), np.float32)
        lib.head_q8_0(normed.ctypes.data, rows, cfg.d_model, self.w.head_q.ctypes.data,
                      self.w.head_scale.ctypes.data, cfg.vocab_size, logits.ctypes.data)  # fmt: skip
        return [logits[spans[i] : spans[i + 1]] for i in range(len(spans) - 1)]

    @classmethod
    def load(cls, path: str | Path, weight_format: str | None = None) -> TorchModel:
        from .torch_store import load_torch_prepared

        return load_torch_prepared(Path(path), weight_format)
