"""Read a GGUF file of a supported family into prepared float32 arrays.

Preparation happens once per file (the result is cached, see `store`): dequantize,
undo llama.cpp's rotary row permutation of Q and K, fuse Q/K/V and gate/up into
single matrices stored (in, out) C-contiguous, and fold the RMS-norm weights into
the matrix that follows each norm. A decode step then costs one product per fused
matrix and no element-wise norm scaling. The families' other norms (per-head QK-norm,
Gemma's post-norms) act on a product's output, so they stay element-wise weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.model.config import Activation, ModelConfig
from pipeline.model.errors import ModelFileError


@dataclass(frozen=True)
class Family:
    """How one `general.architecture` departs from the llama block, as llama.cpp's graph for it
    computes. What a file states (head width, window, bases, scaling) is read from the file; these
    are the rules llama.cpp hard-codes per architecture, so a file never states them."""

    # llama.cpp's converter interleaves rotary pairs in Q/K rows (llama); the others are written
    # in rotate-half order and run with NEOX-style rotation, the same rotate-half we use.
    permuted: bool
    qkv_bias: bool = True  # Q/K/V biases are read when the file has them (llama.cpp loads them)
    rope_freqs: bool = True  # a rope_freqs.weight tensor divides the RoPE frequencies (Llama 3)
    qk_norm: bool = False
    post_norms: bool = False
    activation: Activation = "silu"
    embed_scaled: bool = False  # the embedding rows times sqrt(d_model)
    # Sliding-window local layers: the window is read from the file (required), the layer pattern
    # too where the file has one, else `swa_period` (llama.cpp's set_swa_pattern), and the local
    # layers' RoPE base is `rope_theta_local` (llama.cpp's rope_freq_base_train_swa: no key).
    sliding: bool = False
    swa_period: int = 0
    rope_theta_local: float = 0.0


FAMILIES = {
    "llama": Family(permuted=True),  # Llama 1-3, SmolLM2; Llama 3's RoPE scaling is rope_freqs
    "qwen2": Family(permuted=False),
    "qwen3": Family(permuted=False, qkv_bias=False, rope_freqs=False, qk_norm=True),
    "gemma3": Family(
        permuted=False, qkv_bias=False, rope_freqs=False, qk_norm=True, post_norms=True,
        activation="gelu_tanh", embed_scaled=True, sliding=True, swa_period=6, rope_theta_local=10000.0,
    ),
}  # fmt: skip
# The widest attention head the kernels hold a row of on the stack (rowkernels.c's MAX_HEAD_DIM).
MAX_HEAD_DIM = 256
# Metadata whose computation no family here performs: a file declaring one is refused, not served wrong.
REFUSED_KEYS = {
    "final_logit_softcapping": "final logit soft-capping",
    "attn_logit_softcapping": "attention logit soft-capping",
}
# RoPE scaling types (`rope.scaling.type`) computed as llama.cpp does: "linear" divides positions by
# `rope.scaling.factor`; llama.cpp applies a factor the same way under "none" (or no type at all).
LINEAR_SCALING = ("none", "", "linear")

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",  # SentencePiece-style vocabularies merge by these
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)

PreparedWeights = dict[str, np.ndarray]


def _open(path: Path) -> Any:
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        return _reader_class()(path)
    except Exception as exc:  # the reader raises ValueError/struct errors/IndexError on junk
        raise ModelFileError(f"{path} is not a readable GGUF file ({exc})") from None


@functools.cache
def _reader_class() -> type:
    """gguf's `GGUFReader` over a plain ndarray view of the file's memory map. The reader slices its
    `data` once for every part of every metadata field, and slicing a `np.memmap` costs a subclass
    object each time: Gemma 3's 262,144-token vocabulary took 10.6 s to open that way, 3.1 s this way
    (the AMD VM, 2026-11-27), and a model is opened twice when it is first prepared. The view still
    reads the same mapped pages, and the tensors' `data` are views of it as before."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = np.asarray(mapped)

    return PlainViewReader


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelFileError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def family_of(arch: str) -> Family:
    family = FAMILIES.get(arch)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ModelFileError(f"unsupported architecture {arch!r} (supported: {supported})")
    return family


def read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    family = family_of(arch)
    for key, what in REFUSED_KEYS.items():
        if float(_field(reader, f"{arch}.{key}", 0.0) or 0.0) != 0.0:
            raise ModelFileError(f"{what} ({arch}.{key}) is not supported")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    d_model = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelFileError(f"value heads of {value_dim} differ from key heads of {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ModelFileError(f"heads of {head_dim} values (the kernels take at most {MAX_HEAD_DIM})")
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelFileError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim})")
    if "rope_freqs.weight" in names and not family.rope_freqs:
        raise ModelFileError(f"a rope_freqs.weight tensor in a {arch} file is not supported")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelFileError("tensor 'token_embd.weight' is missing")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else int(embed.shape[1])))
    n_layers = int(_field(reader, f"{arch}.block_count"))
    return ModelConfig(
        architecture=arch,
        name=str(_field(reader, "general.name", "unnamed")),
        n_layers=n_layers,
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
        qkv_bias=family.qkv_bias and "blk.0.attn_q.bias" in names,
        rope_freq_factors="rope_freqs.weight" in names,
        activation=family.activation,
        qk_norm=family.qk_norm,
        post_norms=family.post_norms,
        embed_scale=float(np.sqrt(d_model)) if family.embed_scaled else 1.0,
        attn_scale=_attention_scale(arch, n_layers, d_model, n_heads),
        rope_scale=_rope_scale(reader, arch),
        **_local_layers(reader, arch, family, n_layers),
    )


def _attention_scale(arch: str, n_layers: int, d_model: int, n_heads: int) -> float:
    """The query scale where it is not head_dim ** -0.5 (0 in the config): llama.cpp scales Gemma 3
    27B's queries (its 62 layers name the size) by (d_model / n_heads) ** -0.5, its
    query_pre_attn_scalar; no GGUF key states it."""
    return (d_model / n_heads) ** -0.5 if arch == "gemma3" and n_layers == 62 else 0.0


def _rope_scale(reader: Any, arch: str) -> float:
    """Linear RoPE scaling's factor (1: none); any other scaling is refused."""
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling not in LINEAR_SCALING:
        raise ModelFileError(f"unsupported rope scaling {scaling!r} (supported: linear)")
    # llama.cpp reads the factor under its current key, else the older rope.scale_linear
    factor = _field(reader, f"{arch}.rope.scaling.factor", None) or _field(
        reader, f"{arch}.rope.scale_linear", 0.0
    )
    if float(factor) < 0:
        raise ModelFileError(f"rope scaling factor {factor} is negative")
    return float(factor) or 1.0


def _local_layers(reader: Any, arch: str, family: Family, n_layers: int) -> dict[str, Any]:
    """The sliding-window fields of the config. Families without local layers ignore a window key,
    as llama.cpp does for them (Qwen 2 files may carry one that their models never enable)."""
    if not family.sliding:
        return {}
    window = int(_field(reader, f"{arch}.attention.sliding_window"))
    if window <= 0:
        raise ModelFileError(f"{arch}.attention.sliding_window is {window}")
    # The file's pattern where it has one, else the family's period (Gemma 3 files carry none).
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", family.swa_period)
    if isinstance(pattern, list):  # one flag per layer, True = local
        if len(pattern) != n_layers:
            raise ModelFileError(f"sliding_window_pattern has {len(pattern)} flags for {n_layers} layers")
        local = tuple(i for i, flag in enumerate(pattern) if flag)
    else:  # llama.cpp's set_swa_pattern(period): every layer local but each period-th
        period = int(pattern)
        local = tuple(i for i in range(n_layers) if period == 0 or i % period < period - 1)
    return {"sliding_window": window, "local_layers": local, "rope_theta_local": family.rope_theta_local}


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


def _elementwise_norms(cfg: ModelConfig) -> tuple[str, ...]:
    """The per-layer norm weights that act on a product's output, so cannot be folded into a matrix:
    kept by their GGUF names, stacked over layers ((layers, head_dim) or (layers, d_model))."""
    qk = ("attn_q_norm", "attn_k_norm") if cfg.qk_norm else ()
    return qk + (("post_attention_norm", "post_ffw_norm") if cfg.post_norms else ())


def read_weights(reader: Any, cfg: ModelConfig) -> PreparedWeights:
    tensors = {t.name: t for t in reader.tensors}
    permuted = FAMILIES[cfg.architecture].permuted
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_dim

    def get(name: str, *shape: int) -> np.ndarray:
        return _tensor(reader, tensors, name, tuple(shape))

    wqkv, bqkv, wo, wgu, wdown = [], [], [], [], []
    norms: dict[str, list[np.ndarray]] = {name: [] for name in _elementwise_norms(cfg)}
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
        for name in _elementwise_norms(cfg):
            norms[name].append(get(p + f"{name}.weight", cfg.head_dim if name.startswith("attn_") else d))

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
    weights |= {name: np.stack(rows) for name, rows in norms.items()}
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
