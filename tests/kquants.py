"""Test-only writers of GGUF block bytes for every type the native backend holds.

gguf-py dequantizes every type but quantizes only the per-block ones (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0). The K types (Q4_K, Q5_K, Q6_K) are written here in ggml's byte layouts by a plain
min/max quantizer: not llama.cpp's search, but every block it writes is valid, and the tests only
ever compare against gguf-py's dequantization of those same bytes.
"""

from __future__ import annotations

import gguf
import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *K_TYPES)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).reshape(*a.shape, 1).view(np.uint8)


def _round(a: np.ndarray) -> np.ndarray:
    return np.floor(a + 0.5)


def _six_bit(values: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block non-negative values as 6-bit integers times one float16 scale per super-block."""
    scale = (top / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ints = np.where(scale > 0, _round(values / scale), 0)
    return scale, np.clip(ints, 0, 63).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes that `gguf.quants.Q4_K.get_scale_min` unpacks into 8 scales and 8 mins."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    return out


def _quantize_k45(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K super-blocks of x (n, 256)."""
    levels = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    span = (sub.max(-1) - low) / levels
    d, sc = _six_bit(span, span.max(-1, keepdims=True))
    dmin, mn = _six_bit(-low, (-low).max(-1, keepdims=True))
    step = (d * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, _round((sub + (dmin * mn)[..., None]) / step), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)  # (n, 8, 32)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    head = [_f16_bytes(d[:, 0]), _f16_bytes(dmin[:, 0]), _pack_scales(sc, mn)]
    if bits == 5:
        fifth = (q >> 4) & 1  # bit s of byte l: value l of sub-block s
        qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
        head.append(qh.astype(np.uint8))
    return np.concatenate([*head, qs], axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (np.abs(step).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d > 0, _round(step / d), 0), -128, 127).astype(np.int8)
        scale = (d * sc)[..., None]
        q = np.where(scale != 0, _round(sub / scale), 0) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # (n, half, quarter, l)
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1)  # fmt: skip
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1), axis=2)
    parts = [ql.reshape(-1, 128), qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d[:, 0])]
    return np.concatenate(parts, axis=-1)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """x (rows, cols) float32 as a `kind` tensor's raw bytes (rows, bytes per row)."""
    if kind not in K_TYPES:
        return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), gguf.GGMLQuantizationType[kind])
    rows = x.shape[0]
    flat = np.ascontiguousarray(x, np.float32).reshape(-1, 256)
    raw = _quantize_q6_k(flat) if kind == "Q6_K" else _quantize_k45(flat, 5 if kind == "Q5_K" else 4)
    return raw.reshape(rows, -1)


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])


def random_raw(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random weights through `quantize`, with the extreme values of every block type included."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    x[0, :8] = (-0.3, 0.3, 0.0, 0.0, -0.3, 0.3, 0.25, -0.25)
    if rows > 1:
        x[1] = np.abs(x[1])  # a row with no negative value: mins of zero
    return quantize(x, kind)
