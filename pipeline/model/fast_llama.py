"""The fast runtime: row-invariant C kernels around a pluggable weight product.

A layer is four weight products (`fast_products`: the native block kernels, or torch's) and
four calls into `rowkernels.c` (norm, RoPE and attention, SiLU, residual-plus-norm). Every one
of them computes a row's values with the same instructions whatever the other rows are, which
`tests/test_row_invariance.py` checks bit for bit; so a position's logits depend neither on
the block size, nor on the batch, nor on prefill chunking.

Float32 throughout between the products: residual stream, norms, RoPE, attention, KV cache.
What the products compute is the backend's `describe()`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.fast_products import NativeProducts
from pipeline.model.llama import LogitRows, batch_parents, logit_rows, validate_batch
from pipeline.model.native import MAX_PARTS, CAttend, CLayer, CMatrix, CPart, CScratch, CSequence, row_kernels
from pipeline.model.native_weights import KINDS, NativeMatrix
from pipeline.model.row_cache import RowCache, layer_slots
from pipeline.model.tokenizer import Tokenizer


def rope_table(
    cfg: ModelConfig, theta: float, scale: float, factors: np.ndarray | None
) -> tuple[np.ndarray, ...]:
    """Rotate-half cos and sin (context, head_dim / 2) for base `theta`, inverse frequencies divided
    by the file's per-frequency factors (Llama 3's rope_freqs) and by a linear scale (positions / scale)."""
    half = cfg.head_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) / half) / scale
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    angles = np.outer(np.arange(cfg.context_length, dtype=np.float64), inv_freq)
    return np.ascontiguousarray(np.cos(angles), np.float32), np.ascontiguousarray(np.sin(angles), np.float32)


def layer_ropes(cfg: ModelConfig, factors: np.ndarray | None) -> list[tuple[np.ndarray, ...]]:
    """Each layer's RoPE tables: global layers at `rope_theta` with the linear scale and the file's
    factors, local (sliding-window) layers at `rope_theta_local` unscaled (llama.cpp's gemma3: the
    local layers' freq_base_swa / freq_scale_swa = 1). Layers of one kind share one table."""
    glob = rope_table(cfg, cfg.rope_theta, cfg.rope_scale, factors)
    if not cfg.local_layers:
        return [glob] * cfg.n_layers
    local = rope_table(cfg, cfg.rope_theta_local or cfg.rope_theta, 1.0, None)
    return [local if cfg.is_local(layer) else glob for layer in range(cfg.n_layers)]


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def c_layers(
    cfg: ModelConfig, layers: list[dict[str, Any]], ropes: list[tuple[np.ndarray, ...]], streamed: bool
) -> ctypes.Array:
    """The layers as layers.c's structs, built once: their arrays are memory-mapped and never move.
    `streamed`: `NativeProducts.streamed` of these weights."""

    def matrix(parts: list[NativeMatrix]) -> CMatrix:
        if len(parts) > MAX_PARTS:
            raise ValueError(f"a product of {len(parts)} parts (layers.c takes {MAX_PARTS})")
        c_parts = [CPart(m.data.ctypes.data, KINDS[m.kind], m.n_out) for m in parts]
        n_out = sum(m.n_out for m in parts)
        return CMatrix((CPart * MAX_PARTS)(*c_parts), len(parts), n_out, parts[0].n_in, streamed)

    slots = layer_slots(cfg)
    return (CLayer * len(layers))(*[
        CLayer(lw["attn_norm"].ctypes.data, lw["ffn_norm"].ctypes.data, _address(lw["bqkv"]),
               _address(lw.get("q_norm")), _address(lw.get("k_norm")), _address(lw.get("post_attn_norm")),
               _address(lw.get("post_ffw_norm")), cos.ctypes.data, sin.ctypes.data,
               cfg.sliding_window if local else 0, index,
               matrix(lw["wqkv"]), matrix(lw["wo"]), matrix(lw["wgu"]), matrix(lw["wdown"]))
        for lw, (cos, sin), (local, index) in zip(layers, ropes, slots, strict=True)
    ])  # fmt: skip


class FastModel:
    """Prepared weights, a product strategy and the forward pass; holds no per-sequence state."""

    row_invariant = True  # a row's bits never depend on the forward's other rows (module docstring)

    def __init__(
        self, cfg: ModelConfig, layers: list[dict[str, Any]], out_norm: np.ndarray, head: NativeMatrix,
        rope_freqs: np.ndarray | None, embed: np.ndarray, tokenizer: Tokenizer | None, products: Any,
        weight_format: str, description: str, step_bytes: int,
    ) -> None:  # fmt: skip
        self.cfg, self.layers, self.out_norm, self.head = cfg, layers, out_norm, head
        self.embed, self.tokenizer, self.products = np.asarray(embed), tokenizer, products
        self.backend, self.weight_format, self.description = products.name, weight_format, description
        self.step_bytes = step_bytes
        self.lib = row_kernels()
        native = isinstance(products, NativeProducts)
        self.head_products = NativeProducts(self.lib, products.streamed if native else True)
        self.ropes = layer_ropes(cfg, rope_freqs)
        self.c_layers = c_layers(cfg, layers, self.ropes, products.streamed) if native else None

    def describe(self) -> str:
        """What this target computes, in one line (bench model, status, audit)."""
        return self.description

    def new_cache(self, capacity: int = 256) -> RowCache:
        return RowCache(self.cfg, capacity)

    def forward(self, cache: RowCache, tokens: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """Logits for `tokens` appended at positions [cache.length, cache.length + T)."""
        return self.forward_batch([(cache, tokens)], all_logits=all_logits)[0]

    def forward_batch(self, batch: Sequence[tuple[Any, ...]], *, all_logits: bool = True) -> list[np.ndarray]:
        """One step for several sequences, each (cache, tokens) or a token tree (cache, tokens,
        parents: `llama.batch_parents`): (T_i, vocab) logits each, or (1, vocab) if not all_logits."""
        return self.forward_features(batch, all_logits=all_logits, features=False)[0]

    def forward_features(
        self, batch: Sequence[tuple[Any, ...]], *, all_logits: LogitRows = True, features: bool = True,
        inputs: np.ndarray | None = None,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:  # fmt: skip
        """`forward_batch`'s logits (`all_logits` per sequence: `llama.logit_rows`), and every row's
        feature: the final norm's output, which the LM head reads and a learned drafter takes as input
        (none unless `features`). `inputs`: the rows the layers start from in place of the tokens'
        embeddings (a draft head's own input rows; a head step runs them through `forward_inputs`,
        which is tested against this). A feature is computed per row like everything else here, so
        it is row-invariant too."""
        cfg = self.cfg
        ids = validate_batch(cfg, batch)
        seqs = [(item[0], shape) for item, shape in zip(batch, batch_parents(batch, ids), strict=True)]
        spans = np.cumsum([0, *(t.size for t in ids)])
        if inputs is None:
            x = np.ascontiguousarray(self.embed[np.concatenate(ids)], dtype=np.float32)
            if cfg.embed_scale != 1.0:  # Gemma: sqrt(d_model), in float32 as llama.cpp scales the rows
                x *= np.float32(cfg.embed_scale)
        else:
            x = np.array(inputs, np.float32, order="C")
        if self.c_layers is not None:
            self.forward_layers_native(x, seqs, spans)
        else:
            self.forward_layers(x, seqs, spans)
        for (cache, _), t in zip(seqs, ids, strict=True):
            cache.length += t.size
        rows, cuts = logit_rows(spans, all_logits)
        every = features or rows is None  # the final norm over every row, else over those read
        normed = self._final_norm(x if every else np.ascontiguousarray(x[rows]))
        read = normed if rows is None or not every else np.ascontiguousarray(normed[rows])
        logits = self.head_products.apply(self.head_products.prepare(read), self.head)
        found = [normed[spans[i] : spans[i + 1]] for i in range(len(batch))] if features else []
        return [logits[cuts[i] : cuts[i + 1]] for i in range(len(batch))], found

    def forward_inputs(self, cache: RowCache, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One chain of rows whose layer inputs are `x` (a draft head's own rows, the native backend):
        every row's logits and feature, the bits `forward_features([(cache, tokens)], inputs=x)` gives,
        without a batch's checks and bookkeeping. A head step is a fraction of a millisecond, and
        between two target forwards (whose weights leave the caches cold) that bookkeeping was about a
        tenth of it (0.52-0.54 against 0.59-0.60 ms a one-row step on the AMD VM)."""
        rows = len(x)
        cache.reserve(cache.length + rows)
        self.forward_layers_native(x, [(cache, None)], np.array([0, rows]))
        cache.length += rows
        normed = self._final_norm(x)
        return self.head_products.apply(self.head_products.prepare(normed), self.head), normed

    def _final_norm(self, hidden: np.ndarray) -> np.ndarray:
        normed, weight = np.empty_like(hidden), self.out_norm.ctypes.data
        rows, d, eps = len(hidden), self.cfg.d_model, self.cfg.rms_eps
        self.lib.rms_norm_f32(hidden.ctypes.data, rows, d, weight, eps, normed.ctypes.data)
        return normed

    def forward_layers(self, x: np.ndarray, batch: Sequence[tuple[RowCache, Any]], spans: np.ndarray) -> None:
        """Every layer over x in place, one Python call per kernel (the torch products' path; the
        native backend runs the same sequence in C: layers.c)."""
        cfg, lib, eps, mm = self.cfg, self.lib, self.cfg.rms_eps, self.products
        n, d, layers = x.shape[0], cfg.d_model, self.layers
        h = np.empty((n, d), np.float32)
        attn = np.empty((n, cfg.q_dim), np.float32)
        act = np.empty((n, cfg.d_ff), np.float32)
        lib.rms_norm_f32(x.ctypes.data, n, d, layers[0]["attn_norm"].ctypes.data, eps, h.ctypes.data)
        for index, lw in enumerate(layers):
            qkv = mm.apply(mm.prepare(h), lw["wqkv"])
            for i, (cache, parents) in enumerate(batch):
                rows = slice(spans[i], spans[i + 1])
                self._attend(index, lw, cache, parents, qkv[rows], attn[rows])
            out = mm.apply(mm.prepare(attn), lw["wo"])
            self._post_norm(out, lw.get("post_attn_norm"))
            lib.add_rms_norm_f32(
                x.ctypes.data, out.ctypes.data, n, d, lw["ffn_norm"].ctypes.data, eps, h.ctypes.data
            )
            gate_up = mm.apply(mm.prepare(h), lw["wgu"])
            activation = lib.gelu_mul_f32 if cfg.activation == "gelu_tanh" else lib.silu_mul_f32
            activation(gate_up.ctypes.data, n, cfg.d_ff, act.ctypes.data)
            down = mm.apply(mm.prepare(act), lw["wdown"])
            self._post_norm(down, lw.get("post_ffw_norm"))
            if index + 1 < len(layers):
                nxt = layers[index + 1]["attn_norm"].ctypes.data
                lib.add_rms_norm_f32(x.ctypes.data, down.ctypes.data, n, d, nxt, eps, h.ctypes.data)
            else:
                lib.add_f32(x.ctypes.data, down.ctypes.data, n * d)

    def forward_layers_native(
        self, x: np.ndarray, batch: Sequence[tuple[RowCache, Any]], spans: np.ndarray
    ) -> None:
        cfg, n = self.cfg, x.shape[0]
        # One buffer carved into layers.c's scratch arrays: a forward of one row is a few
        # milliseconds, and an allocation and a ctypes address per array cost a measurable part of it.
        offsets, total = self._scratch_offsets(n)
        scratch = np.empty(total, np.uint8)
        base = -(-scratch.ctypes.data // 64) * 64
        c_scratch = CScratch(**{name: base + offset for name, offset in offsets.items()})
        seqs = (CSequence * len(batch))(*[
            CSequence(int(spans[i]), int(spans[i + 1] - spans[i]), cache.length, cache.stride,
                      cache.local_stride, cache.base, cache.k.ctypes.data, cache.v.ctypes.data,
                      cache.local_k.ctypes.data, cache.local_v.ctypes.data, _address(parents))
            for i, (cache, parents) in enumerate(batch)
        ])  # fmt: skip
        self.lib.forward_layers(
            x.ctypes.data, n, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps,
            cfg.query_scale, cfg.activation == "gelu_tanh", self.c_layers, cfg.n_layers, seqs, len(batch),
            ctypes.byref(c_scratch),
        )  # fmt: skip

    def _scratch_offsets(self, n: int) -> tuple[dict[str, int], int]:
        """Byte offsets of layers.c's scratch arrays for n rows (each 64-byte aligned), and the total."""
        cfg = self.cfg
        widest = max(cfg.d_model, cfg.q_dim, cfg.d_ff)
        sizes = {"h": 4 * cfg.d_model, "qkv": 4 * (cfg.q_dim + 2 * cfg.kv_dim), "attn": 4 * cfg.q_dim,
                 "gate_up": 8 * cfg.d_ff, "act": 4 * cfg.d_ff, "out": 4 * cfg.d_model, "xq": widest,
                 "dx": widest // 8, "sx": widest // 8, "sh": widest // 8}  # fmt: skip
        offsets, total = {}, 0
        for name, size in sizes.items():
            offsets[name] = total
            total += -(-n * size // 64) * 64
        return offsets, total + 64

    def _post_norm(self, out: np.ndarray, weight: np.ndarray | None) -> None:
        """Gemma's norm of an attention or feed-forward output before the residual add, in place."""
        if weight is not None:
            n, d, eps = out.shape[0], out.shape[1], self.cfg.rms_eps
            self.lib.rms_norm_f32(out.ctypes.data, n, d, weight.ctypes.data, eps, out.ctypes.data)

    def _attend(
        self, index: int, lw: dict[str, Any], cache: RowCache, parents: np.ndarray | None, qkv: np.ndarray,
        out: np.ndarray,
    ) -> None:  # fmt: skip
        """Rotate and store this sequence's new K/V in layer `index` of its cache, attend, write `out`."""
        cfg = self.cfg
        kt, v, stride, base = cache.layer_buffers(index)
        local, _ = cache.slots[index]
        cos, sin = self.ropes[index]
        spec = CAttend(_address(lw["bqkv"]), _address(lw.get("q_norm")), _address(lw.get("k_norm")),
                       cfg.rms_eps, cos.ctypes.data, sin.ctypes.data, cfg.sliding_window if local else 0,
                       base)  # fmt: skip
        self.lib.rope_attend_f32(
            qkv.ctypes.data, ctypes.byref(spec), qkv.shape[0], cache.length, _address(parents),
            kt.ctypes.data, v.ctypes.data, stride, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            float(cfg.query_scale), out.ctypes.data,
        )  # fmt: skip
