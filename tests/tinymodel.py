"""Tiny GGUF files of every supported family written with the `gguf` writer, and a float64 reference.

The reference is the textbook block on the *unpermuted* weights (rotate-half RoPE, repeat-kv
GQA, full causal softmax, no cache, no fusion, no folding), so any mistake in the runtime's
loading or fused forward shows up as a logit mismatch. Its family rules (which layers are
local, QK-norm, post-norms, GeGLU, the embedding scale) are written out here from llama.cpp's
graphs, not imported from the runtime, so a wrong rule there cannot hide behind the same rule here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

from . import kquants

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Control tokens, the 256 byte-level symbols, then a few merges."""
    alphabet = ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda c: (ord(c) > 255, ord(c)))
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + byte_symbols + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


@dataclass
class TinySpec:
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 96
    tied: bool = True
    architecture: str = "llama"
    qkv_bias: bool = False
    context: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0
    quant: str = "F32"  # the matrices' block type (tests/kquants.py: BLOCK_TYPES), or "Q4_K_M": tensor_type
    scale: float = 0.35
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    # The families' departures from the llama block ("qwen3", "gemma3"; Llama 3 is "llama" with
    # rope_freqs or rope_scale). head_size: a head width other than d_model // n_heads, written
    # as attention.key_length / value_length (Gemma 3 270M: 256 with d_model 640).
    head_size: int = 0
    # gemma3: attention.sliding_window, and attention.sliding_window_pattern when not None (an int
    # period as llama.cpp's set_swa_pattern, or one bool per layer, True = local); None leaves
    # the key out, so the reader's family default (period 6) applies.
    sliding_window: int = 0
    swa_pattern: int | tuple[bool, ...] | None = None
    rope_theta_local: float = 10000.0  # the base the reference uses on local layers (never written)
    rope_scale: float = 1.0  # linear RoPE scaling: rope.scaling.type = linear, rope.scaling.factor
    rope_freqs: bool = False  # a rope_freqs.weight tensor of per-frequency divisors (Llama 3)
    # Further metadata keys, written by value type (bool, int as uint32, float as float32, str).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "gemma3")

    @property
    def gemma(self) -> bool:
        """Gemma 3's extras: post-norms, GeGLU, sqrt(d_model) embedding scale, local layers."""
        return self.architecture == "gemma3"

    @property
    def vocab(self) -> int:
        return len(tiny_vocab()[0])


def random_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    d, f, q, kv = spec.d_model, spec.d_ff, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * spec.scale / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)

    def head_norm() -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(spec.head_dim)).astype(np.float32)

    w = {"token_embd.weight": mat(spec.vocab, d) * 4, "output_norm.weight": norm()}
    if not spec.tied:
        w["output.weight"] = mat(spec.vocab, d) * 4
    if spec.rope_freqs:
        w["rope_freqs.weight"] = (1.0 + 3.0 * rng.random(spec.head_dim // 2)).astype(np.float32)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        w |= {
            p + "attn_norm.weight": norm(),
            p + "ffn_norm.weight": norm(),
            p + "attn_q.weight": mat(q, d) * 3,
            p + "attn_k.weight": mat(kv, d) * 3,
            p + "attn_v.weight": mat(kv, d),
            p + "attn_output.weight": mat(d, q),
            p + "ffn_gate.weight": mat(f, d),
            p + "ffn_up.weight": mat(f, d),
            p + "ffn_down.weight": mat(d, f),
        }
        if spec.qkv_bias:
            w |= {
                p + "attn_q.bias": (0.1 * rng.standard_normal(q)).astype(np.float32),
                p + "attn_k.bias": (0.1 * rng.standard_normal(kv)).astype(np.float32),
                p + "attn_v.bias": (0.1 * rng.standard_normal(kv)).astype(np.float32),
            }
        if spec.qk_norm:
            w |= {p + "attn_q_norm.weight": head_norm(), p + "attn_k_norm.weight": head_norm()}
        if spec.gemma:
            w |= {p + "post_attention_norm.weight": norm(), p + "post_ffw_norm.weight": norm()}
    return w


def tensor_type(spec: TinySpec, name: str, n_in: int) -> str:
    """A 2-D tensor's block type. "Q4_K_M" mixes them as llama-quantize does: Q6_K for V, the
    down projection and the embedding, Q4_K elsewhere, and where a row is not a whole number of
    256-value super-blocks, Q5_0 (for Q4_K) or Q8_0 (for Q6_K)."""
    if spec.quant != "Q4_K_M":
        return spec.quant
    wide = any(part in name for part in ("attn_v", "ffn_down", "token_embd", "output."))
    if n_in % 256:
        return "Q8_0" if wide else "Q5_0"
    return "Q6_K" if wide else "Q4_K"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models."""
    n_out = w.shape[0]
    return w.reshape(n_heads, 2, n_out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_family_keys(writer: gguf.GGUFWriter, spec: TinySpec) -> None:
    if spec.head_size:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    if spec.swa_pattern is not None:
        pattern = spec.swa_pattern
        writer.add_sliding_window_pattern(pattern if isinstance(pattern, int) else list(pattern))
    if spec.rope_scale != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scale)
    for key, value in spec.extra.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))


def write_tiny_gguf(path: Path, spec: TinySpec) -> dict[str, np.ndarray]:
    """Write the model; return the unpermuted float32 weights the reference uses."""
    weights = spec.weights or random_weights(spec)
    arch = spec.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{spec.seed}")
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.d_ff)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_dimension_count(spec.head_dim)
    _write_family_keys(writer, spec)
    tokens, types, merges = tiny_vocab()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    reference = {}
    for name, array in weights.items():
        if arch == "llama" and ".attn_q." in name:
            array = _permute(array, spec.n_heads)
        elif arch == "llama" and ".attn_k." in name:
            array = _permute(array, spec.n_kv_heads)
        kind = tensor_type(spec, name, array.shape[-1]) if array.ndim == 2 else "F32"
        if kind != "F32":
            writer.add_tensor(name, kquants.quantize(array, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, array)
        # Quantization is per row, so it commutes with the row permutation: the
        # reference sees exactly the values the file holds, in unpermuted order.
        original = weights[name]
        if kind != "F32":
            original = kquants.dequantize(kquants.quantize(original, kind), kind).reshape(original.shape)
        reference[name] = original
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def local_layers(spec: TinySpec) -> list[bool]:
    """Which layers attend through the sliding window: llama.cpp's gemma3 loader, set_swa_pattern(6)
    unless the file says otherwise (layer l is local when l % period < period - 1)."""
    if not (spec.gemma and spec.sliding_window):
        return [False] * spec.n_layers
    pattern = 6 if spec.swa_pattern is None else spec.swa_pattern
    if isinstance(pattern, int):
        return [pattern == 0 or i % pattern < pattern - 1 for i in range(spec.n_layers)]
    return list(pattern)


def _rms(v: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g


def _rope_tables(spec: TinySpec, w: dict[str, np.ndarray], t: int, local: bool) -> tuple[np.ndarray, ...]:
    """cos and sin (t, head_dim) for rotate-half RoPE: local layers use their own base and no scaling."""
    hd = spec.head_dim
    inv_freq = (spec.rope_theta_local if local else spec.rope_theta) ** (-np.arange(0, hd, 2) / hd)
    if "rope_freqs.weight" in w:
        inv_freq = inv_freq / w["rope_freqs.weight"]
    positions = np.arange(t) / (1.0 if local else spec.rope_scale)
    angles = np.outer(positions, inv_freq)
    return np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))


def _reference_attention(
    w: dict[str, np.ndarray], spec: TinySpec, i: int, h: np.ndarray, local: bool
) -> np.ndarray:
    t, hd, p = h.shape[0], spec.head_dim, f"blk.{i}."
    cos, sin = _rope_tables(spec, w, t, local)

    def rope(v: np.ndarray) -> np.ndarray:  # (heads, t, hd)
        rotated = np.concatenate([-v[..., hd // 2 :], v[..., : hd // 2]], -1)
        return v * cos + rotated * sin

    q, k, v = (h @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
    q, k = q.reshape(t, spec.n_heads, hd), k.reshape(t, spec.n_kv_heads, hd)
    if spec.qk_norm:
        q, k = _rms(q, w[p + "attn_q_norm.weight"], spec.eps), _rms(k, w[p + "attn_k_norm.weight"], spec.eps)
    q, k = rope(q.transpose(1, 0, 2)), rope(k.transpose(1, 0, 2))
    v = v.reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
    repeat = spec.n_heads // spec.n_kv_heads
    k, v = np.repeat(k, repeat, axis=0), np.repeat(v, repeat, axis=0)
    distance = np.arange(t)[:, None] - np.arange(t)[None, :]  # query position - key position
    hidden = (distance < 0) | (local & (distance >= spec.sliding_window))
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.where(hidden, -np.inf, 0.0)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(t, -1) @ w[p + "attn_output.weight"].T


def reference_logits(w: dict[str, np.ndarray], spec: TinySpec, tokens: list[int]) -> np.ndarray:
    """Logits for every position of `tokens`, computed the slow, obvious way in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    x = w["token_embd.weight"][tokens] * (np.sqrt(spec.d_model) if spec.gemma else 1.0)
    for i, local in enumerate(local_layers(spec)):
        p = f"blk.{i}."
        out = _reference_attention(w, spec, i, _rms(x, w[p + "attn_norm.weight"], spec.eps), local)
        x = x + (_rms(out, w[p + "post_attention_norm.weight"], spec.eps) if spec.gemma else out)
        h = _rms(x, w[p + "ffn_norm.weight"], spec.eps)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        if spec.gemma:  # GELU, tanh approximation
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1 + np.exp(-gate))
        out = (act * up) @ w[p + "ffn_down.weight"].T
        x = x + (_rms(out, w[p + "post_ffw_norm.weight"], spec.eps) if spec.gemma else out)
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w["output_norm.weight"], spec.eps) @ head.T
