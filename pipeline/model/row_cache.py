"""The fast runtime's KV cache: the reference's KVCache contract in the C kernels' layout, with the
sliding-window layers (Gemma 3's local layers) keeping only their window.

Global layers keep every position in one buffer that grows with the sequence. Local layers, whose
query at position i reads only keys i - window + 1 .. i, keep positions [base, length) in a
buffer of their own: when `reserve` runs out of room there it first drops what no query will read
again (positions before length - (window - 1) - WINDOW_MARGIN) by moving the kept tail to the
front, so a long context costs the window there, not the history. The kernels index that buffer
by position - base and start every key list at the window's first position, so a row's bits never
depend on whether, or where, the buffer was compacted.

WINDOW_MARGIN is how far behind the newest reserve a rollback may go and still find its keys:
the deepest rollback the decoders make is a rejected verify block or a model drafter's k drafts,
at most K_LIMIT (32, `decoding.adaptive`) tokens plus the pending one, 33; 64 are kept.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.llama import KVCache, move_path

WINDOW_MARGIN = 64


def _stride(capacity: int) -> int:
    """The transposed keys' row stride: a multiple of 16 elements (32 bytes), and never a multiple of
    256, whose rows would all map to a few cache sets (measured with float32 keys: attention 1.5x
    slower at a stride of 1024). A stride that is not a multiple of 16 starts each row at an odd
    place in its cache lines: on the AMD VM a forward of 8 one-row sequences at 86 positions took
    9.6 ms at a stride of 141 against 8.7-9.0 ms at strides of 144 to 224, and 10.6 against 10.0-10.2
    in another round (a one-off script: 8 caches per stride, filled alike, forwards taking turns)."""
    stride = -(-capacity // 16) * 16
    return stride + 16 if stride % 256 == 0 else stride


def windowed(cfg: ModelConfig) -> bool:
    """Whether the model has local layers whose window is shorter than its context."""
    return bool(cfg.local_layers) and 0 < cfg.sliding_window < cfg.context_length


def layer_slots(cfg: ModelConfig) -> list[tuple[bool, int]]:
    """Each layer's place in a RowCache: (in the local buffer, its index among its buffer's layers)."""
    local = [windowed(cfg) and cfg.is_local(layer) for layer in range(cfg.n_layers)]
    return [(is_local, sum(local[:layer]) if is_local else layer - sum(local[:layer]))
            for layer, is_local in enumerate(local)]  # fmt: skip


KV_DTYPE = np.float16  # kernels.h's kv_t: each key and value rounded once, when written
HUGE_PAGE_ADVICE_BYTES = 4 << 20  # numpy advises transparent huge pages for arrays from this size on


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """A KV buffer of zeros whose memory the kernel commits a 4 KB page at a time, as it is first
    written, never in huge pages.

    numpy advises transparent huge pages for arrays of 4 MB and more, and keys are stored transposed,
    one row per layer, kv head and dimension: the first keys a prefill writes then commit the 2 MB
    around every row, most of the buffer at once, and a doubling's new buffer is zeroed almost whole
    before its copy. On the AMD VM a step of the default model that grew its cache stalled 31-97 ms
    at 1,024 positions and 210-235 ms at 2,048 that way, and 40 and 73-79 ms from an anonymous map,
    which the kernel zero-fills page by page."""
    nbytes = int(np.prod(shape)) * np.dtype(KV_DTYPE).itemsize
    if nbytes < HUGE_PAGE_ADVICE_BYTES:
        return np.zeros(shape, KV_DTYPE)
    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where the system puts every anonymous map in huge pages
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, KV_DTYPE).reshape(shape)


class RowCache(KVCache):
    """keys (layers, n_kv, head_dim, stride), values (layers, n_kv, stride, head_dim), IEEE halves
    (`KV_DTYPE`), numpy so the kernels take their addresses directly; `k`/`v` hold the global layers,
    `local_k`/`local_v` the sliding-window layers (none when the model has none), slot s there
    holding position base + s.
    """

    def __init__(self, cfg: ModelConfig, capacity: int = 256) -> None:
        self.window = cfg.sliding_window if windowed(cfg) else 0
        self.slots = layer_slots(cfg)
        self.n_local = sum(local for local, _ in self.slots)
        self.base, self.local_capacity, self.local_stride = 0, 0, 0
        self.local_k = self.local_v = np.zeros((0, cfg.n_kv_heads, cfg.head_dim, 1), KV_DTYPE)
        super().__init__(cfg, capacity)

    def _alloc(self, capacity: int) -> None:
        c, n_global = self.cfg, self.cfg.n_layers - self.n_local
        stride = _stride(capacity)
        k = lazy_zeros((n_global, c.n_kv_heads, c.head_dim, stride))
        v = lazy_zeros((n_global, c.n_kv_heads, stride, c.head_dim))
        if self.length:
            k[..., : self.length] = self.k[..., : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self.capacity, self.stride = k, v, capacity, stride
        if self.n_local and self.local_capacity == 0:
            self._alloc_local(min(capacity, self.window + WINDOW_MARGIN), 0)

    def _alloc_local(self, capacity: int, keep_from: int) -> None:
        """A local buffer of `capacity` slots holding positions [keep_from, length) from slot 0."""
        c, stride = self.cfg, _stride(capacity)
        k = lazy_zeros((self.n_local, c.n_kv_heads, c.head_dim, stride))
        v = lazy_zeros((self.n_local, c.n_kv_heads, stride, c.head_dim))
        held = slice(keep_from - self.base, self.length - self.base)
        if held.stop > held.start:
            k[..., : held.stop - held.start] = self.local_k[..., held]
            v[:, :, : held.stop - held.start] = self.local_v[:, :, held]
        self.local_k, self.local_v, self.local_capacity, self.local_stride = k, v, capacity, stride
        self.base = keep_from

    def reserve(self, length: int) -> None:
        super().reserve(length)
        # Room for the window, the margin and as much again, so a compaction moves about one position
        # per token decoded; a forward of more rows (a prefill chunk) gets what it needs, given back
        # at the next reserve that fits the steady size.
        steady = 2 * (self.window + WINDOW_MARGIN)
        oversized = self.local_capacity > steady
        if not self.n_local or (length - self.base <= self.local_capacity and not oversized):
            return
        keep_from = max(self.base, self.length - (self.window - 1) - WINDOW_MARGIN)
        held, need = self.length - keep_from, length - keep_from
        if oversized and need <= steady:
            self._alloc_local(steady, keep_from)
        elif need <= self.local_capacity:  # compact in place: the kept tail to the front
            self.local_k[..., :held] = self.local_k[..., keep_from - self.base : self.length - self.base]
            self.local_v[:, :, :held] = self.local_v[:, :, keep_from - self.base : self.length - self.base]
            self.base = keep_from
        else:
            self._alloc_local(max(need, min(2 * self.local_capacity, steady)), keep_from)

    def first_needed(self, length: int) -> int:
        """The first position a query at `length` reads in the local layers."""
        return max(0, length - (self.window - 1)) if length else 0

    def truncate(self, length: int) -> None:
        if self.n_local and 0 <= length <= self.length:
            if length == 0:
                self.base = 0
            elif self.base > self.first_needed(length):
                raise ValueError(
                    f"cannot roll a sliding-window cache of {self.length} tokens back to {length}: its local "
                    f"layers hold positions from {self.base} on, and position {length} reads from "
                    f"{self.first_needed(length)} (a rollback may go {WINDOW_MARGIN} positions behind the "
                    f"last reserve)"
                )
        super().truncate(length)

    def lends(self, length: int) -> bool:
        """Whether `adopt(self, length)` can copy positions [0, length): a local buffer that has
        dropped keys position `length` reads cannot (the caller prefills instead)."""
        held = not self.n_local or length == 0 or self.base <= self.first_needed(length)
        return 0 <= length <= self.length and held

    def adopt(self, source: KVCache, length: int) -> None:
        """The reference's `adopt` (a prompt prefix another sequence computed), for both buffers;
        ValueError when `source`'s local layers no longer hold what position `length` reads."""
        if not isinstance(source, RowCache) or source.cfg != self.cfg:
            raise ValueError("a cache adopts positions only from a cache of the same fast model")
        if not source.lends(length):
            raise ValueError(
                f"cannot adopt {length} positions of a cache of {source.length} whose local layers hold "
                f"positions from {source.base} on"
            )
        self.length = self.base = 0
        KVCache.reserve(self, length)  # the global buffer; the local one is laid out here
        self.k[..., :length] = source.k[..., :length]
        self.v[:, :, :length] = source.v[:, :, :length]
        if self.n_local:
            keep_from = max(source.base, length - (self.window - 1) - WINDOW_MARGIN, 0) if length else 0
            if length - keep_from > self.local_capacity:
                self._alloc_local(length - keep_from, 0)
            self.base = keep_from
            held = slice(keep_from - source.base, length - source.base)
            self.local_k[..., : length - keep_from] = source.local_k[..., held]
            self.local_v[:, :, : length - keep_from] = source.local_v[:, :, held]
        self.length = length

    def keep(self, start: int, slots: Sequence[int]) -> None:
        """The reference's tree compaction, in both buffers (a local slot is position - base)."""
        if self.n_local and start < self.base:
            raise ValueError(
                f"tree rows from {start} are not in a local buffer holding positions from {self.base} on"
            )
        super().keep(start, slots)

    def move_kept(self, start: int, rows: list[int], moved: int) -> None:
        super().move_kept(start, rows, moved)
        if self.n_local:
            move_path(self.local_k, self.local_v, start - self.base, rows, moved)

    def layer_buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Layer `layer`'s keys and values, its buffer's stride and the position its slot 0 holds."""
        local, index = self.slots[layer]
        if local:
            return self.local_k[index], self.local_v[index], self.local_stride, self.base
        return self.k[index], self.v[index], self.stride, 0
