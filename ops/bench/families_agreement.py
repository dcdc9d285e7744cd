"""Does speclanes compute the Gemma 3 270M file (or another family's GGUF) as llama.cpp does?

On 8 completion prompts (the base model continues text and code), tokenized by llama.cpp and fed
as the same ids to both sides so that only the forward pass is compared, this reports:

- greedy agreement over 64 tokens: the runtime users run (`load_model(path)`) decodes greedily
  beside llama.cpp; where they part, the top-2 margin of both runtimes' logits there (a parting at
  a margin under 0.1 is a near-tie, not an error). The float32 oracle (the numpy backend) is
  checked the same way, teacher-forced on llama.cpp's tokens (the same first parting, one pass);
- the logits of the first generated position: the largest difference of llama.cpp's from the
  oracle's and the runtime's, over the whole vocabulary;
- perplexity of the fixed text (pipeline/bench/quality_text.txt, llama.cpp's token ids) under
  the oracle, the runtime and llama.cpp.

With --f32 it also runs llama.cpp on a float32 copy of the file (every tensor dequantized, as the
oracle holds it; float32 KV cache, no flash attention) and checks the oracle against that: with
the quantization of activations and of the KV cache gone, what is left to differ is the block's
math, so the figures there are a check of the family rules themselves.

With --write-fixture it stores llama.cpp's answers (prompt ids, greedy tokens and margins, the
first position's top logits) and the oracle's perplexity in tests/fixtures/gemma3_llama_cpp.json,
which tests/test_gemma3_llama_cpp.py checks the runtime against without llama.cpp (CI has none).

    .venv/bin/python ops/bench/families_agreement.py [--model PATH] [--tokens 64] [--f32] [--json]
        [--write-fixture]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.bench.agreement import greedy, margin, parting, perplexity, teacher_forced  # noqa: E402
from pipeline.bench.model_bench import QUALITY_TEXT  # noqa: E402
from pipeline.model import load_model  # noqa: E402
from pipeline.model.default import gemma3_path  # noqa: E402
from pipeline.model.store import cache_root  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "gemma3_llama_cpp.json"
NEAR_TIE = 0.1
TOP = 64  # the first position's logits kept in the fixture: llama.cpp's top 64
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village at the edge of the forest,",
    "The three primary colors are",
    "Photosynthesis is the process by which plants",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import numpy as np\n\n# Compute the mean of each row of a matrix\ndef row_means(matrix):\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "<html>\n<head>\n  <title>My first page</title>\n",
)

LLAMA_CPP = r"""
import json, sys, numpy as np, llama_cpp
path, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
job = json.loads(sys.stdin.read())
exact = {"type_k": 0, "type_v": 0, "flash_attn": False} if job["f32"] else {}  # 0: GGML_TYPE_F32
m = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, logits_all=True, verbose=False, **exact)
prompts = [m.tokenize(p.encode(), add_bos=True, special=False) for p in job["prompts"]]
rows, firsts = [], []
for prompt in prompts:
    m.reset(); m.eval(prompt); tokens, margins = [], []
    for step in range(n):
        logits = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)
        if step == 0:
            firsts.append(logits)
        top2 = np.sort(logits)[-2:]; tokens.append(int(logits.argmax()))
        margins.append(float(top2[1] - top2[0])); m.eval([tokens[-1]])
    rows.append({"prompt_ids": prompt, "tokens": tokens, "margins": margins})
text = m.tokenize(job["text"].encode(), add_bos=True, special=False)
del m
m = llama_cpp.Llama(model_path=path, n_ctx=len(text), n_threads=2, logits_all=True, verbose=False, **exact)
m.eval(text)
z = np.array(m.scores[: len(text) - 1], dtype=np.float64)
z -= z.max(axis=-1, keepdims=True)
log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
ppl = float(np.exp(-log_probs[np.arange(len(text) - 1), text[1:]].mean()))
np.save(out, np.stack(firsts))
print(json.dumps({"rows": rows, "text_ids": text, "perplexity": ppl, "version": llama_cpp.__version__}))
"""


def llama_cpp_answers(path: Path, n: int, *, f32: bool = False) -> tuple[dict[str, Any], np.ndarray]:
    """In a child process: a crashing llama.cpp build shows as an error, not as this script's death."""
    with tempfile.TemporaryDirectory() as tmp:
        firsts = Path(tmp) / "first.npy"
        done = subprocess.run(
            [sys.executable, "-c", LLAMA_CPP, str(path), str(n), str(firsts)],
            input=json.dumps({"prompts": PROMPTS, "text": QUALITY_TEXT.read_text(), "f32": f32}),
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp exited with {done.returncode}: {done.stderr.strip()[-400:]}")
        return json.loads(done.stdout), np.load(firsts)


def dequantized_copy(path: Path) -> Path:
    """`path` with every tensor dequantized to float32 and the same metadata (made once, cached)."""
    import gguf
    from gguf.quants import dequantize

    target = cache_root() / "bench-models" / f"{path.stem}.f32.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(staging), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(
            name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None
        )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    staging.rename(target)
    return target


def run_side(
    model: Any, peer: dict[str, Any], firsts: np.ndarray, n: int, *, decode: bool, ppl: float | None = None
) -> dict[str, Any]:
    """One speclanes runtime against llama.cpp's answers: greedy (or teacher-forced), first logits,
    perplexity (unless given: the same model's, measured already), and the seconds each took."""
    rows, started = [], time.perf_counter()
    for row, first_peer in zip(peer["rows"], firsts, strict=True):
        if decode:
            tokens, margins, first = greedy(model, row["prompt_ids"], n)
        else:
            logits = teacher_forced(model, row["prompt_ids"], row["tokens"])
            tokens, margins, first = logits.argmax(-1).tolist(), [margin(z) for z in logits], logits[0]
        at = parting(tokens, row["tokens"])
        rows.append({
            "identical": at is None, "first_difference": at,
            "our_margin": None if at is None else margins[at],
            "llama_cpp_margin": None if at is None else row["margins"][at],
            "first_logits_max_abs": float(np.abs(first - first_peer).max()),
            "first_logits_scale": float(np.abs(first_peer).max()),
            "tokens": tokens,
        })  # fmt: skip
    greedy_s = time.perf_counter() - started
    ppl = perplexity(model, peer["text_ids"]) if ppl is None else ppl
    return {
        "backend": f"{model.backend}:{model.weight_format}", "describe": model.describe(), "rows": rows,
        "greedy_s": greedy_s, "perplexity": ppl, "perplexity_s": time.perf_counter() - started - greedy_s,
        "llama_cpp_perplexity": peer["perplexity"],
    }  # fmt: skip


def compare(path: Path, n: int, *, f32: bool) -> dict[str, Any]:
    peer, firsts = llama_cpp_answers(path, n)
    runtime = load_model(path)
    sides = {"runtime": run_side(runtime, peer, firsts, n, decode=True)}
    del runtime  # the oracle's float32 weights take 1.1 GB beside it
    oracle = load_model(path, "numpy")
    if sides["runtime"]["backend"].startswith("numpy"):
        sides["oracle"] = sides["runtime"]
    else:  # teacher-forced: one block per prompt
        sides["oracle"] = run_side(oracle, peer, firsts, n, decode=False)
    result = {
        "model": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tokens": n,
        "llama_cpp": peer["version"], "text_tokens": len(peer["text_ids"]), "peer": peer, "firsts": firsts,
        "sides": sides,
    }  # fmt: skip
    if f32:
        peer32, firsts32 = llama_cpp_answers(dequantized_copy(path), n, f32=True)
        ppl = sides["oracle"]["perplexity"]
        sides["oracle, llama.cpp on f32"] = run_side(oracle, peer32, firsts32, n, decode=False, ppl=ppl)
        result |= {"peer32": peer32, "firsts32": firsts32}
    return result


def _answers(peer: dict[str, Any], firsts: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for row, first in zip(peer["rows"], firsts, strict=True):
        ids = np.argsort(-first)[:TOP]
        rows.append({
            "prompt_ids": row["prompt_ids"], "tokens": row["tokens"],
            "margins": [round(m, 4) for m in row["margins"]],
            "first_top_ids": ids.tolist(), "first_top_logits": [round(float(v), 4) for v in first[ids]],
        })  # fmt: skip
    return rows


def fixture(result: dict[str, Any]) -> dict[str, Any]:
    """What the CI tests need of llama.cpp's answers (on the file, and with --f32 on its float32
    copy), and the oracle's perplexity: a few tens of KB."""
    answers = {
        "model_sha256": result["sha256"], "llama_cpp": result["llama_cpp"], "near_tie": NEAR_TIE,
        "prompts": list(PROMPTS), "rows": _answers(result["peer"], result["firsts"]),
        "text_ids": result["peer"]["text_ids"],
        "perplexity": {"oracle": result["sides"]["oracle"]["perplexity"],
                       "llama_cpp": result["peer"]["perplexity"]},
    }  # fmt: skip
    if "peer32" in result:
        peer32 = result["peer32"]
        assert [r["prompt_ids"] for r in peer32["rows"]] == [r["prompt_ids"] for r in result["peer"]["rows"]]
        assert peer32["text_ids"] == result["peer"]["text_ids"]
        answers["f32"] = {"rows": _answers(peer32, result["firsts32"]), "perplexity": peer32["perplexity"]}
    return answers


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: {result['tokens']} greedy tokens per prompt against llama.cpp "
             f"{result['llama_cpp']} (the same token ids)"]  # fmt: skip
    for name, side in result["sides"].items():
        lines += ["", f"{name}: {side['describe']}", f"{'prompt':<40}{'same':>6}{'parts at':>10}"
                  f"{'margin: ours / theirs':>24}{'first logits |Δ| / scale':>28}"]  # fmt: skip
        for text, r in zip(PROMPTS, side["rows"], strict=True):
            where = "" if r["identical"] else str(r["first_difference"])
            margins = "" if r["identical"] else f"{r['our_margin']:.3f} / {r['llama_cpp_margin']:.3f}"
            delta = f"{r['first_logits_max_abs']:.3f} / {r['first_logits_scale']:.1f}"
            lines.append(
                f"{text[:38]!r:<40}{'yes' if r['identical'] else 'no':>6}{where:>10}{margins:>24}{delta:>28}"
            )
        ties = [r for r in side["rows"] if not r["identical"]]
        worst = max((max(r["our_margin"], r["llama_cpp_margin"]) for r in ties), default=0.0)
        flip = max((r["our_margin"] + r["llama_cpp_margin"] for r in ties), default=0.0)
        lines.append(
            f"{len(side['rows']) - len(ties)} of {len(side['rows'])} identical; largest margin at a parting "
            f"{worst:.3f} ({'under' if worst < NEAR_TIE else 'NOT under'} {NEAR_TIE}), largest sum of "
            f"the two {flip:.3f}; perplexity over "
            f"{result['text_tokens']} tokens {side['perplexity']:.4f}, llama.cpp's "
            f"{side['llama_cpp_perplexity']:.4f}; {side['greedy_s']:.0f} s greedy, "
            f"{side['perplexity_s']:.0f} s perplexity"
        )
    oracle, runtime = result["sides"]["oracle"]["perplexity"], result["sides"]["runtime"]["perplexity"]
    peer = result["sides"]["runtime"]["llama_cpp_perplexity"]
    lines += ["", f"perplexity: oracle {oracle:.4f}, runtime {runtime:.4f} ({runtime / oracle - 1:+.3%}), "
              f"llama.cpp {peer:.4f} ({peer / oracle - 1:+.3%})"]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--f32", action="store_true", help="also run llama.cpp on a dequantized copy")
    parser.add_argument("--write-fixture", action="store_true", help=f"write {FIXTURE.relative_to(ROOT)}")
    args = parser.parse_args()
    result = compare(args.model or gemma3_path(), args.tokens, f32=args.f32)
    if args.write_fixture:
        FIXTURE.write_text(json.dumps(fixture(result), separators=(",", ":")) + "\n")
    shown = {k: v for k, v in result.items() if k not in ("peer", "firsts", "peer32", "firsts32")}
    print(json.dumps(shown, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
