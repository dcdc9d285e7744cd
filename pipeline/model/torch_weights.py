"""The torch backend's matrices: torch's int4 group-32 layout where the file holds 4-bit blocks.

torch's `_weight_int4pack_mm_for_cpu` computes w = (q - 8) * scale + zero, so Q4_1's (d, m, q)
is scale = d, zero = m + 8d, and Q4_0's is scale = d, zero = 0. The 4-bit values are kept
exactly; scale and zero are rounded from the file's float16 to bfloat16, the only form the fast
kernel takes. Any other matrix type, or a product whose parts mix types, is held as bfloat16
(`F.linear`). The choice is made per matrix at load time, never per forward. The LM head and
everything else come from `native_weights` (the head is a native product in both backends).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pipeline.model.native_weights import Parts, dequantize


class Int4Matrix(NamedTuple):
    packed: torch.Tensor  # torch's CPU int4 packing of (out, in) values 0..15
    scale_zero: torch.Tensor  # (in / 32, out, 2) bfloat16


def can_pack_int4() -> bool:
    """Whether this torch has the CPU int4 kernels (2.5 and later do)."""
    needed = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    return all(hasattr(torch, name) for name in needed)


def torch_matrix(parts: Parts, weight_format: str) -> Int4Matrix | torch.Tensor:
    """A layer product's parts (native_weights.Parts) in the torch backend's form."""
    blocks = parts[0][0]
    if weight_format != "int4" or len(parts) > 1 or blocks.kind not in ("Q4_0", "Q4_1"):
        dense = np.concatenate([dequantize(b) for b, _ in parts])
        return torch.from_numpy(dense).to(torch.bfloat16)
    d = blocks.d.astype(np.float32)
    zero = np.zeros_like(d) if blocks.kind == "Q4_0" else blocks.m.astype(np.float32) + 8 * d
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(blocks.q.astype(np.int32)), 1)
    scale_zero = torch.from_numpy(np.stack([d, zero], axis=-1).swapaxes(0, 1).copy())
    return Int4Matrix(packed, scale_zero.to(torch.bfloat16).contiguous())
