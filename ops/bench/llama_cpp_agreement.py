"""Does speclanes' native runtime decode a K-quant file as llama.cpp does? Greedy tokens side by side.

Both runtimes read the same file's blocks and quantize activations to 8 bits, but not in the same
way (llama.cpp: per 256 values for K-quants, speclanes: per 32), so their logits differ in the
last digits and a greedy answer may part where two tokens nearly tie. For each prompt (the
default model's chat template, the same token ids fed to both) this decodes 64 greedy tokens with
each and reports the first position where they differ, with the top-2 margin of both runtimes'
logits there: a parting at a margin under 0.1 is a near-tie, not a kernel error. It also gives
the largest difference of each runtime's logits at the first generated position from the float32
reference's on the same file (the numpy runtime on its dequantized weights): which of the two
strays further from the weights both read.

Without --model it first writes the default model requantized to Q4_K_M with llama.cpp's own
`llama-quantize --allow-requantize` (built by `ops/bench/install_peers.sh`), the mixed file a
user would get: Q5_0 where rows are 576 wide, Q4_K and Q6_K where they are 1536.

    .venv/bin/python ops/bench/llama_cpp_agreement.py [--model PATH] [--tokens 64] [--json]

Perplexity against the float32 reference is `speclanes bench model --model PATH` (its Δppl).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.agreement import greedy
from pipeline.bench.common import WORKLOADS
from pipeline.bench.pipeline_bench import LOAD_PROMPTS
from pipeline.model import default_model_path, load_model
from pipeline.model.store import cache_root

PROMPTS = (WORKLOADS["chat"], WORKLOADS["code"], *LOAD_PROMPTS[1:4])
QUANTIZE = Path(__file__).resolve().parents[2] / ".venv/peers/llama.cpp/build/bin/llama-quantize"
NEAR_TIE = 0.1


def requantized_default(kind: str = "Q4_K_M") -> Path:
    """The default model requantized by llama-quantize (made once, kept in the cache)."""
    target = cache_root() / "bench-models" / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if target.is_file():
        return target
    if not QUANTIZE.is_file():
        sys.exit(f"llama-quantize not found at {QUANTIZE}: run `bash ops/bench/install_peers.sh`")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    command = [str(QUANTIZE), "--allow-requantize", str(default_model_path()), str(staging), kind, "2"]
    subprocess.run(command, check=True, capture_output=True)
    staging.rename(target)
    return target


def llama_cpp_greedy(path: Path, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    """In a child process: a crashing llama.cpp build shows as an error, not as this script's death."""
    code = (
        "import json, sys, numpy as np, llama_cpp\n"
        "path, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())\n"
        "m = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=2, logits_all=True, verbose=False)\n"
        "out = []\n"
        "for prompt in prompts:\n"
        "    m.reset(); m.eval(prompt); tokens, margins, first = [], [], None\n"
        "    for _ in range(n):\n"
        "        logits = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)\n"
        "        first = logits.tolist() if first is None else first\n"
        "        top2 = np.sort(logits)[-2:]; tokens.append(int(logits.argmax()))\n"
        "        margins.append(float(top2[1] - top2[0])); m.eval([tokens[-1]])\n"
        "    out.append({'tokens': tokens, 'margins': margins, 'first': first})\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(n)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def compare(path: Path, n: int) -> dict[str, Any]:
    model, reference = load_model(path, "native"), load_model(path, "numpy")
    prompts = [
        model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": p}])) for p in PROMPTS
    ]
    peers = llama_cpp_greedy(path, prompts, n)
    rows = []
    for text, prompt, peer in zip(PROMPTS, prompts, peers, strict=True):
        tokens, margins, first = greedy(model, prompt, n)
        exact = reference.forward(reference.new_cache(len(prompt)), prompt, all_logits=False)[-1]
        parted = next(
            (i for i, (a, b) in enumerate(zip(tokens, peer["tokens"], strict=True)) if a != b), None
        )
        rows.append({
            "prompt": text[:48], "identical": parted is None, "first_difference": parted,
            "speclanes_margin": None if parted is None else margins[parted],
            "llama_cpp_margin": None if parted is None else peer["margins"][parted],
            "speclanes_vs_f32": float(np.abs(first - exact).max()),
            "llama_cpp_vs_f32": float(np.abs(np.array(peer["first"], np.float32) - exact).max()),
            "first_logits_scale": float(np.abs(exact).max()),
        })  # fmt: skip
    return {"model": str(path), "kernel_path": model.describe(), "tokens": n, "rows": rows}


def render(result: dict[str, Any]) -> str:
    header = f"{'prompt':<50}{'same':>6}{'parts at':>10}{'margin: ours / theirs':>24}"
    header += f"{'|Δ| to f32: ours / theirs':>28}"
    lines = [
        f"{result['model']}: {result['tokens']} greedy tokens, speclanes native against llama.cpp",
        f"speclanes: {result['kernel_path']}",
        "",
        header,
    ]
    for r in result["rows"]:
        where = "" if r["identical"] else str(r["first_difference"])
        margins = "" if r["identical"] else f"{r['speclanes_margin']:.3f} / {r['llama_cpp_margin']:.3f}"
        delta = f"{r['speclanes_vs_f32']:.3f} / {r['llama_cpp_vs_f32']:.3f} of {r['first_logits_scale']:.0f}"
        lines.append(
            f"{r['prompt']:<50}{'yes' if r['identical'] else 'no':>6}{where:>10}{margins:>24}{delta:>28}"
        )
    ties = [r for r in result["rows"] if not r["identical"]]
    ok = all(min(r["speclanes_margin"], r["llama_cpp_margin"]) < NEAR_TIE for r in ties)
    lines.append("")
    lines.append(
        f"{len(result['rows']) - len(ties)} of {len(result['rows'])} identical; "
        + ("every parting is at a near-tie (top-2 margin < 0.1)" if ok else "a parting is NOT at a near-tie")
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, help="a GGUF (default: the default model requantized to Q4_K_M)"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = compare(args.model or requantized_default(), args.tokens)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
