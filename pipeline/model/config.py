"""Model hyper-parameters, read once from GGUF metadata and cached beside the weights."""

from __future__ import annotations

import msgspec


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: str
    name: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_freq_factors: bool

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
