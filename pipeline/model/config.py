"""Model hyper-parameters, read once from GGUF metadata and cached beside the weights.

One struct describes every supported family (`gguf_file.FAMILIES`). The fields after
`rope_freq_factors` are the ways a family's block departs from the llama block; their defaults
are the llama block, so a llama or qwen2 file's config reads as it always did.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# The feed-forward's gate activation: SiLU (llama, qwen) or GELU with the tanh approximation (Gemma).
Activation = Literal["silu", "gelu_tanh"]


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
    activation: Activation = "silu"
    # Per-head RMS norm (with its own weight, attn_q_norm / attn_k_norm) of Q and K before RoPE:
    # Gemma 3, Qwen 3.
    qk_norm: bool = False
    # RMS norms (post_attention_norm / post_ffw_norm) of the attention and feed-forward outputs,
    # before each is added to the residual stream: Gemma 2 and 3.
    post_norms: bool = False
    # The embedding rows are multiplied by this before the first layer (Gemma: sqrt(d_model)).
    embed_scale: float = 1.0
    # The query scale before the attention softmax; 0 means head_dim ** -0.5.
    attn_scale: float = 0.0
    # Local (sliding-window) attention: a query at position i sees keys (i - sliding_window, i].
    # `local_layers` lists the layers that use it (the rest attend to the whole context), each with
    # RoPE base `rope_theta_local`. Both empty / 0 for families without local layers.
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    rope_theta_local: float = 0.0
    # Linear RoPE scaling of the global layers (`rope.scaling.type = linear`): positions divided by it.
    rope_scale: float = 1.0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def query_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def is_local(self, layer: int) -> bool:
        return layer in self.local_layers
