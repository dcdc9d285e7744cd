"""Tiny llama-family GGUF files written with the `gguf` writer, and a float64 reference.

The reference is the textbook llama block on the *unpermuted* weights (rotate-half
RoPE, repeat-kv GQA, full causal softmax, no cache, no fusion, no folding), so any
mistake in the runtime's loading or fused forward shows up as a logit mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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

    w = {"token_embd.weight": mat(spec.vocab, d) * 4, "output_norm.weight": norm()}
    if not spec.tied:
        w["output.weight"] = mat(spec.vocab, d) * 4
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


def reference_logits(w: dict[str, np.ndarray], spec: TinySpec, tokens: list[int]) -> np.ndarray:
    """Logits for every position of `tokens`, computed the slow, obvious way in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    t, hd = len(tokens), spec.head_dim
    x = w["token_embd.weight"][tokens]
    inv_freq = spec.rope_theta ** (-np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(t), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + spec.eps) * g

    def rope(v: np.ndarray) -> np.ndarray:  # (heads, t, hd)
        rotated = np.concatenate([-v[..., hd // 2 :], v[..., : hd // 2]], -1)
        return v * cos + rotated * sin

    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
        q = rope(q.reshape(t, spec.n_heads, hd).transpose(1, 0, 2))
        k = rope(k.reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2))
        v = v.reshape(t, spec.n_kv_heads, hd).transpose(1, 0, 2)
        repeat = spec.n_heads // spec.n_kv_heads
        k, v = np.repeat(k, repeat, axis=0), np.repeat(v, repeat, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(t, -1)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return rms(x, w["output_norm.weight"]) @ head.T
