"""How the fast runtime multiplies activations by weights: one strategy per backend.

Both take float32 activations and give float32 outputs, so `fast_llama` runs one forward for
either; both are row-invariant (a row's outputs never depend on the other rows):
- `NativeProducts` ("native"): activations quantized to 8 bits per block of 32, times the GGUF's
  own 4/5/6/8-bit blocks with exact integer sums (products.c; AVX512-VNNI where the CPU has it).
- `TorchProducts` ("torch"): bfloat16 activations times torch's int4 group-32 layout
  (`_weight_int4pack_mm_for_cpu`) or bfloat16 matrices (`F.linear`, one row per call: oneDNN's
  bf16 GEMM picks its blocking by the row count, and on Zen 4 (AVX512-BF16) that changed single
  rows' bits at about 1 forward in 13; a one-row product always takes the same path).
The LM head is a native product (of its file blocks) in both, so its logits come out in float32.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from pipeline.model.native_weights import KINDS, NativeMatrix


class Quantized:
    """One activation matrix in 8-bit blocks: values, per-block scale, per-block sum and the sum of
    each block's first 16 values (for Q6_K's halves)."""

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width
        self.q = np.empty((rows, width), np.int8)
        self.scale = np.empty((rows, width // 32), np.float32)
        self.sums = np.empty((rows, width // 32), np.int32)
        self.half_sums = np.empty((rows, width // 32), np.int32)


class NativeProducts:
    """`streamed`: the weights it multiplies by are a target model's, read once a forward and larger than
    the caches, so the kernels let them pass through without evicting what is read again (products.c's
    gemm_blocks); False for a draft head's few MB, read again between two target forwards."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, streamed: bool = True) -> None:
        self.lib, self.streamed = lib, streamed

    def prepare(self, x: np.ndarray) -> Quantized:
        rows, width = x.shape
        quantized = Quantized(rows, width)
        self.lib.quantize_q8(x.ctypes.data, rows, width, quantized.q.ctypes.data, quantized.scale.ctypes.data,
                             quantized.sums.ctypes.data, quantized.half_sums.ctypes.data)  # fmt: skip
        return quantized

    def apply(self, a: Quantized, w: NativeMatrix | list[NativeMatrix]) -> np.ndarray:
        """a times the matrix, or times its parts side by side (a layer's product)."""
        parts = w if isinstance(w, list) else [w]
        n = sum(part.n_out for part in parts)
        out = np.empty((a.rows, n), np.float32)
        column = 0
        for part in parts:
            self.lib.gemm_blocks(a.q.ctypes.data, a.scale.ctypes.data, a.sums.ctypes.data,
                                 a.half_sums.ctypes.data, a.rows, a.width, part.data.ctypes.data,
                                 KINDS[part.kind], part.n_out, out.ctypes.data + 4 * column, n,
                                 self.streamed)  # fmt: skip
            column += part.n_out
        return out


class TorchProducts:
    name = "torch"

    def prepare(self, x: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(x).to(torch.bfloat16)

    def apply(self, a: Any, w: Any) -> np.ndarray:
        import torch

        from pipeline.model.torch_weights import Int4Matrix

        if isinstance(w, Int4Matrix):
            out = torch._weight_int4pack_mm_for_cpu(a, w.packed, 32, w.scale_zero)
        else:
            out = torch.cat([torch.nn.functional.linear(row, w) for row in a.split(1)])
        return out.float().numpy()
