"""A learned drafter's head on the native kernels: EAGLE's one decoder layer over the target's features.

Row p of the head reads [the embedding of token p + 1; the target's feature at p] (the feature is
the target's final-norm output, `forward_features`), projects it to the model width (`fc`), runs
one llama decoder layer with its own KV cache, and normalises the result into a predicted feature
for position p + 1. That prediction times the target's own output rows for a reduced draft
vocabulary (the few thousand tokens the target emits most, FR-Spec) gives the logits of the token
at p + 2; the prediction is also the feature the next draft row reads.

The head's weights are quantized to 5-bit blocks (once per head file, then kept in the weight cache:
`packed_matrices`) and its layer runs through the same C code as the target's
(`FastModel.forward_inputs`), so a draft row costs about one target layer plus a
product over the draft vocabulary. Its numbers change only which tokens are drafted, never
the output: a drafted token is a point proposal, verified exactly.

The file is an .npz of float16 weights plus a JSON record (`meta`): the target it was trained for
(name, shape, the SHA-256 of its embedding rows) and how it was made.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from pipeline.model.config import ModelConfig
from pipeline.model.errors import ModelFileError
from pipeline.model.fast_llama import FastModel, RowCache
from pipeline.model.fast_products import NativeProducts
from pipeline.model.fast_store import FORMAT_VERSION, stored_arrays
from pipeline.model.native import row_kernels
from pipeline.model.native_weights import NativeMatrix, pack, quantize_blocks
from pipeline.model.store import cache_root, form_directory

log = logging.getLogger(__name__)

HEAD_FORMAT = 1
WEIGHT_KIND = "Q5_0"  # the head's weights: 5-bit blocks cost 35% fewer bytes than Q8_0 for ~1% of acceptance
SHIPPED = Path(__file__).parent / "heads"  # heads made by `speclanes drafter train` for the default model
HEAD_SUFFIX = ".head.npz"
MATRICES = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
NORMS = ("attn_norm", "ffn_norm", "out_norm")
LAYER_MATRICES = ("wqkv", "wo", "wgu", "wdown")  # as the kernels take them (`pack_matrices`)
PACKED = ("fc", *LAYER_MATRICES, "head")
PACKED_VERSION = 2  # the cached packed head's own layout, beside the tiles' (fast_store.FORMAT_VERSION)


def embedding_digest(embed: np.ndarray) -> str:
    """A target's identity for its heads: the SHA-256 of its embedding's shape and of every 64th
    embedding row (a head trained for one model is useless, though harmless, on another with the
    same shape). A sample, not every row: the orchestrator and the draft lane check it at each
    start, and the default model's 113 MB of rows took 0.19 s to hash, its sample 3 ms."""
    rows = np.ascontiguousarray(np.asarray(embed)[::64], np.float32)
    return hashlib.sha256(repr(np.shape(embed)).encode() + rows.tobytes()).hexdigest()


def head_config(target: ModelConfig, d_ff: int) -> ModelConfig:
    """The head's layer shape: the target's attention shape, its own feed-forward width."""
    return ModelConfig(
        architecture=target.architecture, name=f"{target.name} draft head", n_layers=1,
        d_model=target.d_model, d_ff=d_ff, n_heads=target.n_heads, n_kv_heads=target.n_kv_heads,
        head_dim=target.head_dim, rope_theta=target.rope_theta, rms_eps=target.rms_eps,
        context_length=target.context_length, vocab_size=target.vocab_size, tied_embeddings=True,
        qkv_bias=False, rope_freq_factors=False,
    )  # fmt: skip


def save_head(path: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Weights as float16 (the draft vocabulary as int32), written whole or not at all."""
    stored = {k: np.asarray(v, np.int32 if k == "vocab" else np.float16) for k, v in arrays.items()}
    stored["meta"] = np.frombuffer(json.dumps({**meta, "format": HEAD_FORMAT}).encode(), np.uint8)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **stored)
    tmp.replace(path)


def read_head(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("meta").tobytes())
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFileError(f"{path}: not a draft head file ({exc})") from exc
    missing = [k for k in (*MATRICES, *NORMS, "vocab") if k not in arrays]
    if meta.get("format") != HEAD_FORMAT or missing:
        raise ModelFileError(f"{path}: draft head format {meta.get('format')!r}, missing {missing}")
    return arrays, meta


def check_target(meta: dict, cfg: ModelConfig, embed: np.ndarray) -> None:
    """ModelFileError unless the head was trained for this target."""
    target = meta.get("target", {})
    if target.get("d_model") != cfg.d_model or target.get("vocab_size") != cfg.vocab_size:
        raise ModelFileError(f"the draft head was trained for {target.get('name')!r}, not {cfg.name!r}")
    if target.get("embedding_sha256") != embedding_digest(embed):
        raise ModelFileError(f"the draft head was trained for another model named {target.get('name')!r}")


class DraftHead:
    """The head ready to run: `step` feeds rows and returns predicted features and draft logits."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict, cfg: ModelConfig, embed: np.ndarray,
                 packed: dict[str, NativeMatrix]) -> None:  # fmt: skip
        """`packed`: the head's matrices as the kernels take them (`packed_matrices`)."""
        f32 = {k: np.asarray(arrays[k], np.float32) for k in NORMS}
        self.vocab = np.asarray(arrays["vocab"], np.int64)
        self.meta, self.embed = meta, embed
        self.cfg = head_config(cfg, int(arrays["w_gate"].shape[0]))
        layer = {
            "attn_norm": f32["attn_norm"], "ffn_norm": f32["ffn_norm"], "bqkv": None,
            **{name: [packed[name]] for name in LAYER_MATRICES},
        }  # fmt: skip
        products = NativeProducts(row_kernels(), streamed=False)  # read again a step later: kept in cache
        self.fc = [packed["fc"]]
        self.products = products
        head, kind = packed["head"], packed["head"].kind
        nbytes = sum(int(packed[name].data.nbytes) for name in PACKED)
        self.model = FastModel(
            self.cfg, [layer], f32["out_norm"], head, None, embed, None, products, kind.lower(),
            "draft head", nbytes,
        )  # fmt: skip

    def new_cache(self, capacity: int = 256) -> RowCache:
        return self.model.new_cache(capacity)

    def step(
        self, cache: RowCache, next_tokens: list[int], features: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows at positions [cache.length, +T): row i reads token next_tokens[i] (the one after
        its position) and features[i]; returns (predicted features, draft-vocabulary logits)."""
        d = self.cfg.d_model
        joined = np.empty((len(next_tokens), 2 * d), np.float32)
        joined[:, :d] = self.embed[next_tokens]
        joined[:, d:] = features
        x = self.products.apply(self.products.prepare(joined), self.fc)
        logits, found = self.model.forward_inputs(cache, x)
        return found, logits


def output_rows(path: Path | None, cfg: ModelConfig, embed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The target's output rows for `ids`: its embedding rows when tied, else the file's output matrix."""
    if cfg.tied_embeddings or path is None:
        return np.asarray(embed[ids], np.float32)
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "output.weight")
    full = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(cfg.vocab_size, cfg.d_model)
    return np.asarray(full[ids], np.float32)


def load_head(path: Path, cfg: ModelConfig, embed: np.ndarray, target_path: Path | None = None) -> DraftHead:
    return _built(_checked(path, cfg, embed), cfg, embed, target_path)


def _checked(path: Path, cfg: ModelConfig, embed: np.ndarray) -> tuple[Path, dict[str, np.ndarray], dict]:
    """The head file at `path`, read, with its target checked (ModelFileError otherwise)."""
    arrays, meta = read_head(path)
    check_target(meta, cfg, embed)
    return path, arrays, meta


def _built(
    checked: tuple[Path, dict, dict], cfg: ModelConfig, embed: np.ndarray, target_path: Path | None
) -> DraftHead:
    path, arrays, meta = checked
    return DraftHead(arrays, meta, cfg, embed, packed_matrices(path, arrays, cfg, embed, target_path))


def pack_matrices(arrays: dict[str, np.ndarray], output: np.ndarray, kind: str) -> dict[str, NativeMatrix]:
    """The head's matrices quantized to `kind` blocks and laid out in the kernels' tiles: `fc`, the
    layer's (Q, K and V in one, gate and up in one) and the draft vocabulary's `output` rows."""
    f32 = {k: np.asarray(v, np.float32) for k, v in arrays.items() if k != "vocab"}
    joined = {
        "fc": f32["fc"], "wqkv": np.concatenate([f32["wq"], f32["wk"], f32["wv"]]), "wo": f32["wo"],
        "wgu": np.concatenate([f32["w_gate"], f32["w_up"]]), "wdown": f32["w_down"], "head": output,
    }  # fmt: skip
    return {
        name: pack(quantize_blocks(np.ascontiguousarray(w, np.float32), kind), exact=False)
        for name, w in joined.items()
    }


def packed_matrices(
    path: Path, arrays: dict[str, np.ndarray], cfg: ModelConfig, embed: np.ndarray, target_path: Path | None,
    kind: str = WEIGHT_KIND,
) -> dict[str, NativeMatrix]:  # fmt: skip
    """`pack_matrices` of the head file at `path`, made once and kept in the weight cache beside the
    models' prepared forms (keyed by the head file's content; the file was checked against this
    target, whose output rows it reads), then memory-mapped back: quantizing took 0.3-0.4 s of the
    start of every lane that serves `learned`, and of its restart after a crash."""
    directory = form_directory(path, f"head-{kind.lower()}-v{FORMAT_VERSION}.{PACKED_VERSION}")

    def build() -> tuple[dict[str, np.ndarray], dict]:
        packed = pack_matrices(arrays, output_rows(target_path, cfg, embed, arrays["vocab"]), kind)
        shapes = {name: [m.kind, m.n_out, m.n_in, m.exact] for name, m in packed.items()}
        return {name: m.data for name, m in packed.items()}, {"shapes": shapes}

    stored, manifest = stored_arrays(directory, build)
    return {
        name: NativeMatrix(k, stored[name], n_out, n_in, exact)
        for name, (k, n_out, n_in, exact) in manifest["shapes"].items()
    }


def trained_heads_directory() -> Path:
    """Where `speclanes drafter train` writes a head by default (found again by `find_head`)."""
    return cache_root() / "heads"


def head_name(model_path: Path) -> str:
    return Path(model_path).name + HEAD_SUFFIX


def find_head(model_path: Path) -> Path | None:
    """The head for the model file at `model_path`: one the user trained, else one shipped here."""
    for directory in (trained_heads_directory(), SHIPPED):
        candidate = directory / head_name(model_path)
        if candidate.is_file():
            return candidate
    return None


def _head_to_serve(
    model_path: Path, cfg: ModelConfig, embed: np.ndarray, explicit: str | Path = ""
) -> tuple[Path, dict, dict] | None:
    """The head file for the model at `model_path`, read and checked: `explicit` (a ModelFileError if
    it is no head for this model), else the one found for the model (None, with a warning, if it was
    trained for another), else None."""
    if explicit:
        return _checked(Path(explicit), cfg, embed)
    found = find_head(Path(model_path))
    if found is None:
        return None
    try:
        return _checked(found, cfg, embed)
    except ModelFileError as exc:
        log.warning("not using the draft head %s: %s", found, exc)
        return None


def head_file(
    model_path: Path, cfg: ModelConfig, embed: np.ndarray, explicit: str | Path = ""
) -> Path | None:
    """The file `head_for` would build, checked but not built (no weights quantized, no kernels): the
    orchestrator and the supervisor ask it whether the draft lane serves `learned`."""
    checked = _head_to_serve(model_path, cfg, embed, explicit)
    return None if checked is None else checked[0]


def head_for(
    model_path: Path, cfg: ModelConfig, embed: np.ndarray, explicit: str | Path | None = None
) -> DraftHead | None:
    """The head to draft with (`_head_to_serve`), built, or None."""
    checked = _head_to_serve(model_path, cfg, embed, explicit or "")
    return None if checked is None else _built(checked, cfg, embed, Path(model_path))


def servable_head(served: Path, cfg: ModelConfig, embed: np.ndarray, explicit: str) -> DraftHead | None:
    """The head a lane drafts `learned` with: the one named (its errors end the lane, and say why),
    else the one found for the model, if this machine can run it (its kernels need a C compiler): a
    found head that cannot be built is left out with a warning, and the lane serves the other drafters."""
    if explicit:
        return head_for(served, cfg, embed, Path(explicit))
    try:
        return head_for(served, cfg, embed)
    except Exception:
        log.warning("not serving the learned drafter: its draft head cannot be built here", exc_info=True)
        return None
