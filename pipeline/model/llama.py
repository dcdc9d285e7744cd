"""A numpy forward pass for every supported family (`gguf_file.FAMILIES`), over several sequences at once.

`Model.forward` takes a batch of (cache, new tokens) pairs. The rows of all
sequences go through each weight product together, so the weights are read once per
step however many sequences are in the batch; attention runs per sequence against its
own KV cache. A single sequence is the batch of one.

This is the oracle the fast runtimes are measured against, so it stays the plain form of each
family's block: a sliding window is a mask over the full KV cache, not a ring buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.gguf_file import PreparedWeights
from pipeline.model.kernels import linear, linear_t
from pipeline.model.store import load_prepared
from pipeline.model.tokenizer import Tokenizer


class KVCache:
    """One sequence's keys and values. `truncate` is the rollback after rejected drafts.

    Keys are stored transposed (head_dim before position) so scores are one plain
    product per layer; capacity doubles as the sequence grows.
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

    def adopt(self, source: KVCache, length: int) -> None:
        """Hold `source`'s first `length` positions (and nothing after them): a prompt prefix another
        sequence already computed (`workers.prefix_reuse`). A position's K/V depend only on the
        tokens up to it, so on a row-invariant runtime these are the bits a prefill would write."""
        if not 0 <= length <= source.length:
            raise ValueError(f"cannot adopt {length} positions of a cache of {source.length}")
        self.reserve(length)
        self.k[..., :length] = source.k[..., :length]
        self.v[:, :, :length] = source.v[:, :, :length]
        self.length = length

    def keep(self, start: int, slots: Sequence[int]) -> None:
        """After a token tree's forward: keep the K/V of the tree rows `slots` (a root-first path,
        as offsets from `start`) at positions start, start + 1, ... and drop every other row.

        A tree row's keys were rotated for its depth, which is its place on the path, so moving
        its K/V is all the compaction there is. The path's rows already in their places stay where
        they are: its first row always, and all of it where it follows the nodes a drafter laid out
        first (the learned head puts its chain before its leaves)."""
        rows, moved = moved_rows(slots)
        if rows and (min(rows) < 0 or start + max(rows) >= self.length):
            raise ValueError(f"tree rows {slots} are not in a cache of {self.length} from {start}")
        self.move_kept(start, rows, moved)
        self.length = start + len(rows)

    def move_kept(self, start: int, rows: list[int], moved: int) -> None:
        """`keep`'s copy of the path's rows into place (`moved_rows`); a cache with buffers of its own
        beside these (`RowCache`'s windowed layers) moves the same rows there too."""
        move_path(self.k, self.v, start, rows, moved)


def moved_rows(slots: Sequence[int]) -> tuple[list[int], int]:
    """A kept tree path's rows, and the index of the first that is not already in place (`len(slots)`
    if none moves): `KVCache.keep` copies only the rows from there on. Plain Python: a path is a few
    rows, and numpy's fixed costs were most of a keep that moved nothing."""
    rows = [int(row) for row in slots]
    return rows, next((i for i, row in enumerate(rows) if row != i), len(rows))


def move_path(k: np.ndarray, v: np.ndarray, at: int, rows: list[int], moved: int) -> None:
    """In one pair of K/V buffers whose slot `at` holds the path's root: rows[moved:] (offsets from
    `at`, from `moved_rows`) copied to slots at + moved, at + moved + 1, ... (nothing where none moves)."""
    if moved < len(rows):
        source = np.asarray(rows[moved:], np.int64) + at
        k[..., at + moved : at + len(rows)] = k[..., source]
        v[:, :, at + moved : at + len(rows)] = v[:, :, source]


@dataclass(frozen=True)
class Rope:
    """Rotate-half rotary tables for every position up to the context length."""

    cos: np.ndarray
    sin: np.ndarray

    @classmethod
    def build(cls, cfg: ModelConfig, freq_factors: np.ndarray | None, *, local: bool = False) -> Rope:
        """The global layers' tables (base `rope_theta`, linear scaling `rope_scale`, the file's
        frequency divisors), or with `local` the sliding-window layers' (base `rope_theta_local`,
        unscaled: llama.cpp's rope_freq_scale_train_swa is 1)."""
        half = cfg.head_dim // 2
        theta = cfg.rope_theta_local if local else cfg.rope_theta
        inv_freq = theta ** (-np.arange(half, dtype=np.float64) / half)
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
        positions = np.arange(cfg.context_length, dtype=np.float64) / (1.0 if local else cfg.rope_scale)
        angles = np.outer(positions, inv_freq)
        return cls(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x (n, heads, head_dim) rotated by each row's position."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm without the weight: the weight is folded into the next matrix."""
    mean_square = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    return x / np.sqrt(mean_square + np.float32(eps))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Gemma's GeGLU gate), in float32."""
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def head_normalize(heads: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """QK-norm: RMS norm of each head (rows, heads, head_dim) of Q and K, times its per-head weight."""
    rows, n, dim = heads.shape
    return rms_normalize(heads.reshape(rows * n, dim), eps).reshape(rows, n, dim) * weight


def softmax_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place: scores are scratch space."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def causal_mask(start: int, rows: int) -> np.ndarray:
    """Additive mask for `rows` queries at positions [start, start + rows) over all keys so far."""
    future = np.arange(start + rows)[None, :] > (start + np.arange(rows))[:, None]
    return np.where(future, np.float32(-np.inf), np.float32(0.0))


def tree_mask(start: int, parents: np.ndarray) -> np.ndarray:
    """Additive mask for a token tree's rows over the cache and the tree: a row sees the cache,
    its ancestors and itself (`parents`: see `batch_parents`)."""
    rows = parents.size
    sees = np.eye(rows, dtype=bool)
    for r in range(rows):
        if parents[r] >= 0:
            sees[r] |= sees[parents[r]]
    visible = np.concatenate([np.ones((rows, start), bool), sees], axis=1)
    return np.where(visible, np.float32(0.0), np.float32(-np.inf))


def window_mask(mask: np.ndarray | None, key_positions: np.ndarray, window: int) -> np.ndarray | None:
    """`mask` (or no mask) with the keys a sliding-window query does not see hidden as well: those at
    `window` or more positions before it. The queries are the last rows of `key_positions`."""
    queries = key_positions[key_positions.size - (1 if mask is None else mask.shape[0]) :]
    far = queries[:, None] - key_positions[None, :] >= window
    if not far.any():
        return mask
    return np.where(far, np.float32(-np.inf), np.float32(0.0) if mask is None else mask)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    depth = np.zeros(parents.size, np.int64)
    for r, parent in enumerate(parents):
        depth[r] = 0 if parent < 0 else depth[parent] + 1
    return depth


def batch_parents(batch: Sequence[tuple[Any, ...]], ids: list[np.ndarray]) -> list[np.ndarray | None]:
    """Each sequence's token-tree shape, or None for a chain. A batch item (cache, tokens,
    parents) is a tree: parents[r] is the row that row r continues (-1: the cache itself), always
    an earlier row. Row r then sits at the position after its ancestors, and sees only them."""
    shapes: list[np.ndarray | None] = []
    for item, t in zip(batch, ids, strict=True):
        parents = item[2] if len(item) > 2 else None
        if parents is None:
            shapes.append(None)
            continue
        parents = np.ascontiguousarray(parents, dtype=np.int32).reshape(-1)
        if parents.size != t.size:
            raise ValueError(f"{parents.size} parents for {t.size} tree tokens")
        if np.any(parents < -1) or np.any(parents >= np.arange(t.size)):
            raise ValueError("a tree row's parent must be -1 or an earlier row")
        shapes.append(parents)
    return shapes


LogitRows = bool | Sequence[bool]  # all of a sequence's rows' logits (True), or its last row's only


def logit_rows(spans: np.ndarray, all_logits: LogitRows) -> tuple[np.ndarray | None, np.ndarray]:
    """The batch rows whose logits a forward computes (None: every row), and where each sequence's
    rows begin among them. `all_logits` says, for every sequence or for each, whether it wants all its
    rows' logits or its last row's only: a prompt chunk beside verify steps needs one row, not a
    product of the whole vocabulary with each of its rows."""
    n = len(spans) - 1
    whole = [all_logits] * n if isinstance(all_logits, bool) else list(all_logits)
    if len(whole) != n:
        raise ValueError(f"all_logits names {len(whole)} sequences for a batch of {n}")
    if all(whole):
        return None, spans
    rows = [np.arange(spans[i], spans[i + 1]) if whole[i] else spans[i + 1 : i + 2] - 1 for i in range(n)]
    return np.concatenate(rows), np.cumsum([0, *(len(r) for r in rows)])


def validate_batch(cfg: ModelConfig, batch: Sequence[tuple[Any, ...]]) -> list[np.ndarray]:
    """Each sequence's new tokens as int64 arrays, checked, with room reserved in its cache.

    Shared by both backends, so a bad batch is refused the same way and before any cache moves.
    """
    if len({id(item[0]) for item in batch}) != len(batch):
        raise ValueError("a cache may appear only once in a batch")
    ids = [np.asarray(item[1], dtype=np.int64).reshape(-1) for item in batch]
    for t in ids:
        if t.size == 0:
            raise ValueError("every sequence in a batch needs at least one new token")
        if t.min() < 0 or t.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
    for item, t in zip(batch, ids, strict=True):
        item[0].reserve(item[0].length + t.size)
    return ids


class Model:
    """Prepared weights plus the forward pass; holds no per-sequence state.

    The reference backend ("numpy:f32"): dequantized float32 weights with the norms folded in,
    float32 everywhere. Its products go through OpenBLAS, whose GEMV (one row) and GEMM (many
    rows) sum in different orders, so unlike the torch backend its logits for a position may
    differ in the last bits between a one-token step and a verify block.
    """

    backend = "numpy"
    weight_format = "f32"
    row_invariant = False  # see above: the verify lane copies no prompt prefixes on it

    def __init__(
        self, cfg: ModelConfig, weights: PreparedWeights, tokenizer: Tokenizer | None = None
    ) -> None:
        self.cfg = cfg
        # Plain ndarray views of the (possibly memory-mapped) arrays, split per layer once:
        # indexing an np.memmap on every step costs more than the norms do.
        self.w = {name: np.asarray(a) for name, a in weights.items()}
        names = ("wqkv", "bqkv", "wo", "wgu", "wdown", "post_attention_norm", "post_ffw_norm")
        self.layers = [
            {name: self.w[name][i] for name in names if name in self.w} for i in range(cfg.n_layers)
        ]
        if cfg.qk_norm:  # one weight row per Q head then per K head, as the heads lie in `qkv`
            for i, lw in enumerate(self.layers):
                q_norm, k_norm = self.w["attn_q_norm"][i], self.w["attn_k_norm"][i]
                lw["qk_norm"] = np.concatenate(
                    [np.tile(q_norm, (cfg.n_heads, 1)), np.tile(k_norm, (cfg.n_kv_heads, 1))]
                )
        self.tokenizer = tokenizer
        self.embed = self.w["embed"]
        self.head = self.w.get("head", self.embed)
        self.rope = Rope.build(cfg, self.w.get("rope_freqs"))
        local = Rope.build(cfg, self.w.get("rope_freqs"), local=True) if cfg.local_layers else None
        self.ropes = [
            local if local is not None and cfg.is_local(i) else self.rope for i in range(cfg.n_layers)
        ]
        self.activation = ACTIVATIONS[cfg.activation]
        # What one decode step reads: every matrix once, the embedding only as the tied head.
        self.step_bytes = sum(int(a.nbytes) for name, a in weights.items() if name != "embed") + (
            int(self.head.nbytes) if cfg.tied_embeddings else 0
        )

    @classmethod
    def load(cls, path: str | Path) -> Model:
        cfg, weights, tokenizer = load_prepared(Path(path))
        return cls(cfg, weights, tokenizer)

    def describe(self) -> str:
        return f"numpy {np.__version__} f32 reference: dequantized float32 weights and activations (OpenBLAS)"

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.cfg, capacity)

    def forward(self, cache: KVCache, tokens: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """Logits for `tokens` appended at positions [cache.length, cache.length + T)."""
        return self.forward_batch([(cache, tokens)], all_logits=all_logits)[0]

    def forward_batch(self, batch: Sequence[tuple[Any, ...]], *, all_logits: bool = True) -> list[np.ndarray]:
        """One step for several sequences, each (cache, tokens) or a token tree (cache, tokens,
        parents): (T_i, vocab) logits each, or (1, vocab) if not all_logits."""
        return self.forward_features(batch, all_logits=all_logits, features=False)[0]

    def forward_features(
        self, batch: Sequence[tuple[Any, ...]], *, all_logits: LogitRows = True, features: bool = True
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`forward_batch`'s logits (`all_logits` per sequence: `logit_rows`), and every row's
        final-norm output when `features` (as the fast runtime's `forward_features`)."""
        cfg = self.cfg
        ids = validate_batch(cfg, batch)
        shapes = batch_parents(batch, ids)
        spans = np.cumsum([0, *(t.size for t in ids)])
        caches = [item[0] for item in batch]
        positions = np.concatenate([
            c.length + (np.arange(t.size) if shape is None else tree_depths(shape))
            for c, t, shape in zip(caches, ids, shapes, strict=True)
        ])  # fmt: skip
        x = self.w["embed"][np.concatenate(ids)]  # fancy indexing copies: x is ours to update
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        eps = cfg.rms_eps
        # Each sequence's mask depends only on its position and block shape: build it once.
        masks = [
            tree_mask(c.length, shape) if shape is not None
            else causal_mask(c.length, t.size) if t.size > 1 else None
            for c, t, shape in zip(caches, ids, shapes, strict=True)
        ]  # fmt: skip
        local_masks = masks
        if cfg.local_layers:
            keys = [
                np.arange(c.length + t.size) if shape is None
                else np.concatenate([np.arange(c.length), c.length + tree_depths(shape)])
                for c, t, shape in zip(caches, ids, shapes, strict=True)
            ]  # fmt: skip
            local_masks = [window_mask(m, k, cfg.sliding_window) for m, k in zip(masks, keys, strict=True)]
        for layer, lw in enumerate(self.layers):
            layer_masks = local_masks if cfg.is_local(layer) else masks
            x = self._layer(layer, lw, x, positions, caches, spans, layer_masks)
        for cache, t in zip(caches, ids, strict=True):
            cache.length += t.size
        every = rms_normalize(x, eps) * self.w["out_norm"] if features else None
        picked, cuts = logit_rows(spans, all_logits)
        rows = np.arange(x.shape[0]) if picked is None else picked
        hidden = every[rows] if every is not None else rms_normalize(x[rows], eps) * self.w["out_norm"]
        logits = linear_t(hidden, self.head)
        found = [] if every is None else [every[spans[i] : spans[i + 1]] for i in range(len(batch))]
        return [logits[cuts[i] : cuts[i + 1]] for i in range(len(batch))], found

    def _layer(
        self,
        layer: int,
        lw: dict[str, np.ndarray],
        x: np.ndarray,
        positions: np.ndarray,
        caches: list[KVCache],
        spans: np.ndarray,
        masks: list[np.ndarray | None],
    ) -> np.ndarray:
        """One block over every row of the batch; returns the updated residual stream `x`."""
        cfg = self.cfg
        q_dim, kv_dim, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_eps
        qkv = linear(rms_normalize(x, eps), lw["wqkv"])
        if "bqkv" in lw:
            qkv += lw["bqkv"]
        heads = qkv[:, : q_dim + kv_dim].reshape(-1, cfg.n_heads + cfg.n_kv_heads, cfg.head_dim)
        if "qk_norm" in lw:
            heads = head_normalize(heads, lw["qk_norm"], eps)
        heads = self.ropes[layer].apply(heads, positions)
        q, k = heads[:, : cfg.n_heads], heads[:, cfg.n_heads :]
        v = qkv[:, q_dim + kv_dim :].reshape(-1, cfg.n_kv_heads, cfg.head_dim)
        attn = np.empty((x.shape[0], q_dim), np.float32)
        for i, cache in enumerate(caches):
            rows = slice(spans[i], spans[i + 1])
            attn[rows] = self._attend(cache, layer, q[rows], k[rows], v[rows], masks[i])
        out = linear(attn, lw["wo"])
        x += rms_normalize(out, eps) * lw["post_attention_norm"] if cfg.post_norms else out
        gate_up = linear(rms_normalize(x, eps), lw["wgu"])
        out = linear(self.activation(gate_up[:, : cfg.d_ff]) * gate_up[:, cfg.d_ff :], lw["wdown"])
        x += rms_normalize(out, eps) * lw["post_ffw_norm"] if cfg.post_norms else out
        return x

    def _attend(
        self, cache: KVCache, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None
    ) -> np.ndarray:
        """Causal GQA attention of T new rows against the cache, writing their K/V into it."""
        cfg = self.cfg
        n, t = cache.length, q.shape[0]
        end = n + t
        cache.k[layer, :, :, n:end] = k.transpose(1, 2, 0)
        cache.v[layer, :, n:end] = v.transpose(1, 0, 2)
        group = cfg.n_heads // cfg.n_kv_heads
        # (t, heads, d) -> (kv_heads, group * t, d): each kv head serves `group` query heads.
        qg = q.reshape(t, cfg.n_kv_heads, group, cfg.head_dim).transpose(1, 2, 0, 3)
        qg = qg.reshape(cfg.n_kv_heads, group * t, cfg.head_dim) * np.float32(cfg.query_scale)
        scores = qg @ cache.k[layer, :, :, :end]
        if mask is not None:
            scores.reshape(cfg.n_kv_heads, group, t, end)[...] += mask
        out = softmax_rows(scores) @ cache.v[layer, :, :end]
        return out.reshape(cfg.n_kv_heads, group, t, cfg.head_dim).transpose(2, 0, 1, 3).reshape(t, -1)
