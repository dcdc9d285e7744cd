"""Every backend side by side in one run: forward cost by block size, prefill, memory floor,
quality against the float32 reference, and llama.cpp's own step times when it is installed.

A decode step must read every weight once, so `bytes read per step / streaming-read
bandwidth` is the floor no kernel can beat; verifying k draft tokens should cost close to
one step because the weights are read once for the whole block. Quality is teacher-forced
over a fixed text (`quality_text.txt`, over 1,000 tokens): perplexity of each backend, top-1
agreement with the reference and the distance of the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench.flags import add_common_flags
from pipeline.model import backend_key, load_model
from pipeline.model.cpu import cpu_name, kernel_flags
from pipeline.model.default import model_path

BLOCK_SIZES = (1, 2, 4, 8, 16)
QUALITY_TEXT = Path(__file__).with_name("quality_text.txt")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page in the weights, settle the thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def streaming_bandwidth(nbytes: int, repeats: int, threads: int = 2) -> float:
    """Bytes/s of a read-and-reduce over a fresh buffer as large as a step's weights, on as many
    threads as the kernels use (numpy reductions release the GIL)."""
    chunks = np.array_split(np.ones(nbytes // 4, dtype=np.float32), threads)
    with ThreadPoolExecutor(threads) as pool:
        return nbytes / median_seconds(lambda: list(pool.map(np.sum, chunks)), repeats)


def step_times(model: Any, context: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(17, model.cfg.vocab_size, size=context)
    cache = model.new_cache(capacity=context + max(BLOCK_SIZES))

    def prefill() -> None:
        cache.truncate(0)
        model.forward(cache, prompt, all_logits=False)

    prefill_s = median_seconds(prefill, max(3, repeats // 3))

    def block(t: int) -> Callable[[], None]:
        tokens = rng.integers(17, model.cfg.vocab_size, size=t)

        def run() -> None:
            model.forward(cache, tokens)
            cache.truncate(context)

        return run

    forward_s = {t: median_seconds(block(t), repeats) for t in BLOCK_SIZES}
    return {
        "prefill_ms": prefill_s * 1e3,
        "prefill_tokens_per_second": context / prefill_s,
        "forward_ms": {str(t): s * 1e3 for t, s in forward_s.items()},
        "ratio_to_t1": {str(t): s / forward_s[1] for t, s in forward_s.items()},
    }


def teacher_forced(model: Any, tokens: list[int]) -> np.ndarray:
    return model.forward(model.new_cache(capacity=len(tokens)), tokens)


def perplexity(logits: np.ndarray, tokens: list[int]) -> float:
    z = logits[:-1].astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(tokens) - 1), tokens[1:]].mean()))


def quality(logits: np.ndarray, reference: np.ndarray, tokens: list[int]) -> dict[str, float]:
    delta = np.abs(logits - reference)
    return {
        "perplexity": perplexity(logits, tokens),
        "perplexity_vs_reference": perplexity(logits, tokens) / perplexity(reference, tokens) - 1,
        "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
        "max_abs_dlogit": float(delta.max()),
        "mean_abs_dlogit": float(delta.mean()),
    }


def llama_cpp_steps(path: Path, context: int, repeats: int) -> dict[str, Any]:
    """llama.cpp's T = 1..16 step times on the same cache length, in a child process (its own
    threads and allocations stay out of ours); {"error": ...} if it is missing or crashes."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.model_bench_llama_cpp", str(path), str(context), str(repeats)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        lines = (done.stderr.strip() or f"exit code {done.returncode}").splitlines()
        return {"error": lines[-1] if done.returncode > 0 else f"crashed (signal {-done.returncode})"}
    return json.loads(done.stdout)


def prefill_stall(model: Any, prompt_tokens: int, chunk: int, context: int) -> dict[str, float]:
    """What a long prompt costs a neighbour that is decoding: the verify lane's loop, replayed.

    Each forward carries the neighbour's one-token step plus at most `chunk` rows of the prompt
    (lanes/verify.py's schedule); the neighbour's longest wait between two tokens is the stall.
    `chunk` = the prompt's length is the old behaviour: the whole prefill in one forward."""
    rng = np.random.default_rng(1)
    neighbour = model.new_cache(capacity=context + 64)
    model.forward(neighbour, rng.integers(17, model.cfg.vocab_size, size=context).tolist(), all_logits=False)
    prompt = rng.integers(17, model.cfg.vocab_size, size=prompt_tokens).tolist()
    cache = model.new_cache(capacity=prompt_tokens + 1)
    gaps = []
    for start in range(0, prompt_tokens, chunk):
        t0 = time.perf_counter()
        model.forward_batch([(neighbour, [5]), (cache, prompt[start : start + chunk])], all_logits=False)
        gaps.append(time.perf_counter() - t0)
        neighbour.truncate(context)
    return {"max_gap_ms": max(gaps) * 1e3, "prefill_ms": sum(gaps) * 1e3}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    path = model_path(args.model)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    # Timings first, fast backends before numpy: OpenBLAS's threads spin for a while after each
    # call and would steal the cores from the next backend's kernels.
    models = {name: load_model(path, name) for name in sorted(backends, key=lambda b: b == "numpy")}
    result: dict[str, Any] = {
        "context": args.context,
        "cpu": cpu_name(),
        "cpu_flags": kernel_flags(),
        "backends": {},
    }
    for name, model in models.items():
        bandwidth = result.setdefault("bandwidth", streaming_bandwidth(model.step_bytes, args.repeats))
        entry = {"key": backend_key(model), "kernel_path": model.describe()}
        entry |= step_times(model, args.context, args.repeats)
        entry["step_bytes"] = model.step_bytes
        entry["memory_floor_ms"] = model.step_bytes / bandwidth * 1e3
        entry["t1_over_floor"] = entry["forward_ms"]["1"] / entry["memory_floor_ms"]
        result["backends"][name] = entry
        print(f"bench model: {name} timed", file=sys.stderr)
    subject_model = models[backends[0]]
    result["prefill_stall"] = {
        "backend": backends[0], "prompt_tokens": 2048,
        "whole_prompt": prefill_stall(subject_model, 2048, 2048, args.context),
        "chunked_128": prefill_stall(subject_model, 2048, 128, args.context),
    }  # fmt: skip
    if not args.no_llama_cpp:
        result["llama_cpp"] = llama_cpp_steps(path, args.context, args.repeats)
    result["model"] = subject_model.cfg.name
    result["file_bytes"] = path.stat().st_size
    if not args.no_quality:
        reference = models.get("numpy") or load_model(path, "numpy")
        text_tokens = reference.tokenizer.encode(QUALITY_TEXT.read_text())
        result["quality_text_tokens"] = len(text_tokens)
        reference_logits = teacher_forced(reference, text_tokens)
        for name, model in models.items():
            logits = reference_logits if model is reference else teacher_forced(model, text_tokens)
            result["backends"][name]["quality"] = quality(logits, reference_logits, text_tokens)
    result["bandwidth_gb_s"] = result.pop("bandwidth") / 1e9
    result["backends"] = {name: result["backends"][name] for name in backends}
    subject = result["backends"].get(backends[0], {})
    numpy_row = result["backends"].get("numpy")
    if numpy_row and subject and backends[0] != "numpy":
        result["speedup_t1_vs_numpy"] = numpy_row["forward_ms"]["1"] / subject["forward_ms"]["1"]
    lc = result.get("llama_cpp", {})
    if "forward_ms" in lc and subject:
        result["speedup_t1_vs_llama_cpp"] = lc["forward_ms"]["1"] / subject["forward_ms"]["1"]
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"model {result['model']}, {result['context']}-token cache; CPU {result['cpu']}",
        f"CPU flags: {' '.join(result['cpu_flags'])}; "
        f"streaming read {result['bandwidth_gb_s']:.1f} GB/s (2 threads)",
        f"quality: teacher-forced over {result['quality_text_tokens']} tokens against numpy:f32"
        if "quality_text_tokens" in result
        else "quality: not measured (--no-quality)",
        "",
    ]
    header = f"{'backend':<12}" + "".join(f"{'T=' + str(t):>8}" for t in BLOCK_SIZES)
    header += (
        f"{'T8/T1':>7}{'T16/T1':>7}{'floor':>7}{'prefill':>9}{'ppl':>8}{'Δppl':>7}{'top1':>7}{'max|Δ|':>8}"
    )
    lines.append(header + "   (ms; prefill tok/s)")
    for e in result["backends"].values():
        row = f"{e['key']:<12}" + "".join(f"{e['forward_ms'][str(t)]:>8.2f}" for t in BLOCK_SIZES)
        row += f"{e['ratio_to_t1']['8']:>7.2f}{e['ratio_to_t1']['16']:>7.2f}{e['memory_floor_ms']:>7.2f}"
        row += f"{e['prefill_tokens_per_second']:>9.0f}"
        if "quality" in e:
            q = e["quality"]
            row += f"{q['perplexity']:>8.3f}{q['perplexity_vs_reference']:>+7.2%}"
            row += f"{q['top1_agreement']:>7.1%}{q['max_abs_dlogit']:>8.3f}"
        lines.append(row)
    lc = result.get("llama_cpp")
    if lc and "forward_ms" in lc:
        f = lc["forward_ms"]
        row = f"{'llama.cpp':<12}" + "".join(f"{f[str(t)]:>8.2f}" for t in BLOCK_SIZES)
        lines.append(row + f"{f['8'] / f['1']:>7.2f}{f['16'] / f['1']:>7.2f}   ({lc.get('version', '')})")
    elif lc:
        lines.append(f"llama.cpp: {lc['error']}")
    lines.append("")
    lines.extend(f"{e['key']}: {e['kernel_path']}" for e in result["backends"].values())
    lines.extend(
        f"{e['key']}: weights read per step {e['step_bytes'] / 1e9:.3f} GB, "
        f"{e['step_bytes'] / result['file_bytes']:.2f}x the file's {result['file_bytes'] / 1e9:.3f} GB"
        for e in result["backends"].values()
    )
    stall = result["prefill_stall"]
    whole, chunked = stall["whole_prompt"], stall["chunked_128"]
    lines.append(
        f"a {stall['prompt_tokens']}-token prompt beside a decoding request ({stall['backend']}): the "
        f"neighbour waits up to {whole['max_gap_ms']:.0f} ms for a token when it is prefilled whole, "
        f"{chunked['max_gap_ms']:.0f} ms in chunks of 128 (prefill {whole['prefill_ms']:.0f} ms vs "
        f"{chunked['prefill_ms']:.0f} ms)"
    )
    for key, label in (("speedup_t1_vs_numpy", "numpy reference"), ("speedup_t1_vs_llama_cpp", "llama.cpp")):
        if key in result:
            lines.append(f"T=1 speed-up of {next(iter(result['backends']))} over {label}: {result[key]:.2f}x")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench model` and its flags."""
    parser = sub.add_parser("model", help="forward cost by block size vs the memory floor")
    add_common_flags(parser, repeats=15)
    parser.add_argument(
        "--backends", default="native,torch,numpy", help="backends side by side (first: the subject)"
    )
    parser.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's row")
    parser.add_argument(
        "--no-quality", action="store_true", help="skip the quality columns (no float32 reference is loaded)"
    )


def main(args: argparse.Namespace) -> int:
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
