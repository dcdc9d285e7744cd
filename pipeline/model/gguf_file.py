"""Read a llama-family GGUF file into prepared float32 arrays.

Preparation happens once per file (the result is cached, see `store`): dequantize,
undo llama.cpp's rotary row permutation of Q and K, fuse Q/K/V and gate/up into
single matrices stored (in, out) C-contiguous, and fold the RMS-norm weights into
the matrix that follows each norm. A decode step then costs one product per fused
matrix and no element-wise norm scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.errors import ModelFileError

# Architectures whose block is the llama block. `permuted`: llama.cpp's converter
# interleaves rotary pairs in Q/K rows for these (it does not for qwen2, which it
# runs with NEOX-style rotation, the same rotate-half we use).
SUPPORTED_ARCHITECTURES = {"llama": {"permuted": True}, "qwen2": {"permuted": False}}

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)

PreparedWeights = dict[str, np.ndarray]


def _open(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors/IndexError on junk
        raise ModelFileError(f"{path} is not a readable GGUF file ({exc})") from None


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelFileError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelFileError(f"unsupported architecture {arch!r} (supported: {supported})")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    d_model = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelFileError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim})")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ModelFileError(f"unsupported rope scaling {scaling!r}")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelFileError("tensor 'token_embd.weight' is missing")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else int(embed.shape[1])))
    return ModelConfig(
        architecture=arch,
        name=str(_field(reader, "general.name", "unnamed")),
        n_layers=int(_field(reader, f"{arch}.block_count")),
        d_model=d_model,
        d_ff=int(_field(reader, f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(_field(reader, f"{arch}.context_length", 2048)),
        vocab_size=vocab,
        tied_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        rope_freq_factors="rope_freqs.weight" in names,
    )


def _tensor(reader: Any, tensors: dict[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize one tensor to float32 in (out, in) order and check its shape."""
    from gguf.quants import dequantize

    tensor = tensors.get(name)
    if tensor is None:
        raise ModelFileError(f"tensor {name!r} is missing")
    try:
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ModelFileError(f"tensor {name!r} has unsupported type {tensor.tensor_type.name}") from None
    if array.shape != shape:
        raise ModelFileError(f"tensor {name!r} has shape {array.shape}, expected {shape}")
    return array


def unpermute_order(n_out: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K row interleaving, so rotate-half RoPE applies.

    Per head, rows go from interleaved rotary pairs back to two halves. As an index it serves
    every form of a matrix: float rows here, quantized blocks in the fast backends."""
    head_dim = n_out // n_heads
    return np.arange(n_out).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(n_out)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w[unpermute_order(w.shape[0], n_heads)]


def read_weights(reader: Any, cfg: ModelConfig) -> PreparedWeights:
    tensors = {t.name: t for t in reader.tensors}
    permuted = SUPPORTED_ARCHITECTURES[cfg.architecture]["permuted"]
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim

    def get(name: str, *shape: int) -> np.ndarray:
        return _tensor(reader, tensors, name, tuple(shape))

    wqkv, bqkv, wo, wgu, wdown = [], [], [], [], []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wq, wk, wv = (
            get(p + "attn_q.weight", q, d),
            get(p + "attn_k.weight", kv, d),
            get(p + "attn_v.weight", kv, d),
        )
        if permuted:
            wq, wk = _unpermute(wq, cfg.n_heads), _unpermute(wk, cfg.n_kv_heads)
        attn_norm = get(p + "attn_norm.weight", d)
        wqkv.append(np.concatenate([wq, wk, wv]).T * attn_norm[:, None])
        if cfg.qkv_bias:
            bq, bk, bv = get(p + "attn_q.bias", q), get(p + "attn_k.bias", kv), get(p + "attn_v.bias", kv)
            if permuted:
                bq = _unpermute(bq[:, None], cfg.n_heads)[:, 0]
                bk = _unpermute(bk[:, None], cfg.n_kv_heads)[:, 0]
            bqkv.append(np.concatenate([bq, bk, bv]))
        wo.append(get(p + "attn_output.weight", d, q).T)
        ffn_norm = get(p + "ffn_norm.weight", d)
        gate, up = get(p + "ffn_gate.weight", f, d), get(p + "ffn_up.weight", f, d)
        wgu.append(np.concatenate([gate, up]).T * ffn_norm[:, None])
        wdown.append(get(p + "ffn_down.weight", d, f).T)

    weights: PreparedWeights = {
        "embed": get("token_embd.weight", cfg.vocab_size, d),
        "out_norm": get("output_norm.weight", d),
        "wqkv": np.ascontiguousarray(np.stack(wqkv)),
        "wo": np.ascontiguousarray(np.stack(wo)),
        "wgu": np.ascontiguousarray(np.stack(wgu)),
        "wdown": np.ascontiguousarray(np.stack(wdown)),
    }
    if cfg.qkv_bias:
        weights["bqkv"] = np.stack(bqkv)
    if not cfg.tied_embeddings:
        weights["head"] = get("output.weight", cfg.vocab_size, d)
    if cfg.rope_freq_factors:
        weights["rope_freqs"] = get("rope_freqs.weight", cfg.head_dim // 2)
    return weights


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    meta = {key: _field(reader, key, None) for key in TOKENIZER_KEYS}
    if meta["tokenizer.ggml.tokens"] is None:
        raise ModelFileError("GGUF has no tokenizer (tokenizer.ggml.tokens is missing)")
    return meta


def read_gguf(path: Path) -> tuple[ModelConfig, PreparedWeights, dict[str, Any]]:
    """Everything a cold start needs from the file, validated; errors are ModelFileError."""
    reader = _open(path)
    cfg = read_config(reader)
    return cfg, read_weights(reader, cfg), read_tokenizer_metadata(reader)
