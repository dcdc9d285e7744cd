"""A benchmark model of the size users run: SmolLM2-1.7B's shapes, random weights, quantized.

The embedded default model (SmolLM2-135M) is small enough that a decode step is dominated by
per-call overheads rather than by reading the weights; the models people actually serve are an
order of magnitude bigger. This script makes such a model without downloading one: a llama-family
GGUF with SmolLM2-1.7B's shapes (d_model 2048, 24 layers, 32 heads and 32 KV heads of 64, FFN 8192,
vocabulary 49152, tied embeddings) whose weights are seeded random normals (std 0.02), carrying the
default model's tokenizer and chat template. Its outputs are meaningless; its speed is real, since
a step reads the same bytes and does the same arithmetic as the trained 1.7B model.

Steps: write the F16 file (streamed, one tensor at a time, fixed seed, so the file is
reproducible), quantize it with llama.cpp's `llama-quantize` (built by
`bash ops/bench/install_peers.sh`) into each requested type (default Q4_K_M and Q4_0), and delete
the F16 file unless `--keep-f16`. Work whose output exists is skipped; every file is written
under a temporary name and renamed into place. About 2 minutes on 2 cores (F16 30 s, Q4_K_M 70 s,
Q4_0 15 s); the outputs are about 1 GB each. Run from the repository's root:

    .venv/bin/python ops/bench/big_model.py [--out DIR] [--types Q4_K_M,Q4_0] [--keep-f16]
                                            [--quantize PATH]

The files land in `$SPECLANES_CACHE/bench-models` (default `~/.cache/speclanes/bench-models`).
Then benchmark on one of them, every backend side by side and llama.cpp on the same file:

    speclanes bench model --model ~/.cache/speclanes/bench-models/bench-1.7b-random.Q4_K_M.gguf

(`bench model` always loads the numpy float32 reference for its quality columns, which prepares
about 7 GB of float32 arrays in the weight cache for this model; the quality columns compare the
backends with each other, the perplexity itself means nothing on random weights.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gguf
import numpy as np

from pipeline.model import default_model_path
from pipeline.model.store import cache_root

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261123
WEIGHT_STD = 0.02
BASENAME = "bench-1.7b-random"
DEFAULT_TYPES = ("Q4_K_M", "Q4_0")
QUANTIZE_THREADS = 2
DEFAULT_QUANTIZE = ROOT / ".venv" / "peers" / "llama.cpp" / "build" / "bin" / "llama-quantize"
CHUNK = 1 << 22  # elements generated at a time, so a big tensor never exists in float32 at once


@dataclass(frozen=True)
class Shapes:
    """A llama block stack's dimensions (head_dim = d_model / n_heads)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    name: str
    size_label: str

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SMOLLM2_1_7B = Shapes(
    d_model=2048,
    n_layers=24,
    n_heads=32,
    n_kv_heads=32,
    d_ff=8192,
    vocab=49152,
    context=8192,
    rope_theta=130000.0,
    rms_eps=1e-5,
    name="SmolLM2-1.7B shapes, random weights (speclanes bench)",
    size_label="1.7B",
)


def tensor_plan(shapes: Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and numpy shape (rows = out, cols = in), each block's in the default model's
    order (its file sorts blocks as strings, blk.10 before blk.2; the order does not matter).
    Tied embeddings: no output.weight."""
    d, f, v = shapes.d_model, shapes.d_ff, shapes.vocab
    q, kv = shapes.n_heads * shapes.head_dim, shapes.n_kv_heads * shapes.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (v, d))]
    for i in range(shapes.n_layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (d,)),
            (p + "ffn_down.weight", (d, f)),
            (p + "ffn_gate.weight", (f, d)),
            (p + "ffn_up.weight", (f, d)),
            (p + "ffn_norm.weight", (d,)),
            (p + "attn_k.weight", (kv, d)),
            (p + "attn_output.weight", (d, q)),
            (p + "attn_q.weight", (q, d)),
            (p + "attn_v.weight", (kv, d)),
        ]
    plan.append(("output_norm.weight", (d,)))
    return plan


def _random_f16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    out = np.empty(shape, dtype=np.float16)
    flat = out.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        chunk = rng.standard_normal(min(CHUNK, flat.size - start), dtype=np.float32)
        chunk *= std
        flat[start : start + chunk.size] = chunk
    return out


def _copy_tokenizer(writer: gguf.GGUFWriter, source: gguf.GGUFReader) -> int:
    """Every tokenizer.ggml.* key and the chat template, with the source's value types."""
    copied = 0
    for key, field in source.fields.items():
        if not (key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
        copied += 1
    return copied


def write_random_model(
    path: Path, shapes: Shapes, source_model: Path, seed: int = SEED, std: float = WEIGHT_STD
) -> None:
    """Write a random-weight F16 llama GGUF of `shapes` with `source_model`'s tokenizer to `path`.

    Norms are F32 ones, matrices F16 normals of `std`; tensor i is drawn from a generator
    seeded with (seed, i), so the file is the same on every run. Tensors are generated and
    written one at a time (peak memory: the largest tensor in F16)."""
    source = gguf.GGUFReader(source_model)
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source_model} has no tokenizer (tokenizer.ggml.tokens is missing)")
    if len(tokens.data) != shapes.vocab:
        raise ValueError(f"vocab {shapes.vocab} != the source tokenizer's {len(tokens.data)} tokens")
    arch = "llama"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type("model")
    writer.add_name(shapes.name)
    writer.add_size_label(shapes.size_label)
    writer.add_block_count(shapes.n_layers)
    writer.add_context_length(shapes.context)
    writer.add_embedding_length(shapes.d_model)
    writer.add_feed_forward_length(shapes.d_ff)
    writer.add_head_count(shapes.n_heads)
    writer.add_head_count_kv(shapes.n_kv_heads)
    writer.add_rope_freq_base(shapes.rope_theta)
    writer.add_layer_norm_rms_eps(shapes.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(shapes.vocab)
    writer.add_rope_dimension_count(shapes.head_dim)
    _copy_tokenizer(writer, source)

    plan = tensor_plan(shapes)
    for name, shape in plan:
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, shape) in enumerate(plan):
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            writer.write_tensor_data(_random_f16(np.random.default_rng([seed, index]), shape, std))
    writer.close()


def type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds, read back with GGUFReader."""
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _report(path: Path) -> None:
    size = path.stat().st_size
    counts = ", ".join(f"{name} {n}" for name, n in type_counts(path).items())
    print(f"{path}  {size / 1e9:.2f} GB ({size} bytes)  tensors: {counts}")


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def _quantize(binary: Path, f16: Path, out: Path, qtype: str) -> None:
    tmp = _partial(out)
    try:
        cmd = [str(binary), str(f16), str(tmp), qtype, str(QUANTIZE_THREADS)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"big_model: llama-quantize {qtype} failed (exit {done.returncode}):\n{tail}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _parse_types(text: str) -> list[str]:
    types = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if f"MOSTLY_{t}" not in gguf.LlamaFileType.__members__]
    if not types or unknown:
        raise argparse.ArgumentTypeError(f"unknown quantization type(s): {', '.join(unknown) or '(none)'}")
    return types


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=cache_root() / "bench-models", help="output directory")
    parser.add_argument(
        "--types",
        type=_parse_types,
        default=list(DEFAULT_TYPES),
        help="llama-quantize types (comma-separated)",
    )
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    parser.add_argument("--quantize", type=Path, default=DEFAULT_QUANTIZE, help="the llama-quantize binary")
    args = parser.parse_args(argv)

    out: Path = args.out.expanduser()
    f16 = out / f"{BASENAME}.F16.gguf"
    targets = {qtype: out / f"{BASENAME}.{qtype}.gguf" for qtype in args.types}
    missing = {qtype: path for qtype, path in targets.items() if not path.is_file()}
    if missing and not (args.quantize.is_file() and os.access(args.quantize, os.X_OK)):
        print(
            f"big_model: llama-quantize not found at {args.quantize}: run `bash ops/bench/install_peers.sh`"
            " (or pass --quantize PATH)",
            file=sys.stderr,
        )
        return 1
    out.mkdir(parents=True, exist_ok=True)

    timings: dict[str, float] = {}
    need_f16 = bool(missing) or args.keep_f16
    if need_f16 and not f16.is_file():
        start = time.perf_counter()
        tmp = _partial(f16)
        try:
            write_random_model(tmp, SMOLLM2_1_7B, default_model_path())
            tmp.replace(f16)
        finally:
            tmp.unlink(missing_ok=True)
        timings["write F16"] = time.perf_counter() - start
        print(f"big_model: wrote {f16} in {timings['write F16']:.1f} s", flush=True)
    elif need_f16:
        print(f"big_model: {f16} exists, not rewritten", flush=True)

    for qtype, path in targets.items():
        if qtype not in missing:
            print(f"big_model: {path} exists, skipped", flush=True)
            continue
        start = time.perf_counter()
        _quantize(args.quantize, f16, path, qtype)
        timings[f"quantize {qtype}"] = time.perf_counter() - start
        print(f"big_model: quantized {qtype} in {timings[f'quantize {qtype}']:.1f} s", flush=True)

    if missing and not args.keep_f16:
        f16.unlink(missing_ok=True)
        print(f"big_model: deleted {f16} (pass --keep-f16 to keep it)")

    print()
    for path in ([f16] if args.keep_f16 else []) + list(targets.values()):
        _report(path)
    if timings:
        print("timings: " + ", ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
