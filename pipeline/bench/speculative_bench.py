"""Every drafter against plain decoding on three workloads, side by side in one run.

Runs are interleaved (each repeat goes through every drafter in turn) so drift on a
shared machine hits all of them alike; figures are medians. Each run gets a fresh
draft source, so the cross-request cache starts empty: speed-ups here come from within
a request, and the check column says whether every output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from ..drafters.registry import make_draft_source
from ..model import Runtime as Model
from ..model import default_model_path, load_model
from ..sampling import SamplingParams
from ..speculative import decode

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small brass "
    "lantern, a notebook bound in green leather, and a flask of strong black tea. At the top he trimmed "
    "the wick, polished the great lens until it shone, and wrote down the direction of the wind, the "
    "colour of the sea and the names of any ships that passed. In forty years he had never missed a "
    "night. The villagers said the light had never once gone dark while he kept it, not even in the "
    "great storm of the winter when the waves reached the windows of the lamp room."
)
CODE = """def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["value"]
            count += 1
    if count == 0:
        return None
    average = total / count
    return {"total": total, "count": count, "average": average}
"""
WORKLOADS = {
    "chat": "Write a short story about a robot who learns to paint.",
    "quote": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "code": "Rename the variable `total` to `running_sum` in this function and show the whole "
    f"updated function:\n\n```python\n{CODE}```",
}


def decode_rate(completion) -> float:
    """Tokens per second after the prompt is in the cache (prefill excluded)."""
    stats = completion.stats
    return len(completion.tokens) / (stats["wall_seconds"] - stats["prefill_seconds"])


def run(model: Model, drafters: list[str], draft_model: Model | None, repeats: int, max_tokens: int) -> dict:
    assert model.tokenizer is not None
    params = SamplingParams(max_tokens=max_tokens)
    results: dict = {}
    for workload, text in WORKLOADS.items():
        prompt = model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": text}]))
        runs: dict[str, list] = {d: [] for d in drafters}
        for _ in range(repeats):
            for name in drafters:
                source = make_draft_source(
                    name, model, draft_model or model if name == "model" else draft_model
                )
                runs[name].append(decode(model, prompt, params, source, k=0 if name == "none" else None))
        reference = runs["none"][0].tokens
        base = statistics.median(r.stats["tokens_per_second"] for r in runs["none"])
        base_decode = statistics.median(decode_rate(r) for r in runs["none"])
        results[workload] = {"prompt_tokens": len(prompt), "drafters": {}}
        for name, completions in runs.items():
            tps = statistics.median(r.stats["tokens_per_second"] for r in completions)
            last = completions[-1].stats
            results[workload]["drafters"][name] = {
                "tokens": len(completions[-1].tokens),
                "tokens_per_second": tps,
                "speedup": tps / base,
                "decode_speedup": statistics.median(decode_rate(r) for r in completions) / base_decode,
                "acceptance_rate": last["acceptance_rate"],
                "mean_accepted_length": last["mean_accepted_length"],
                "identical_to_none": all(r.tokens == reference for r in completions),
            }
    return results


def render(results: dict) -> str:
    lines = [
        f"{'workload':<8} {'drafter':<8} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} {'accept':>7} "
        f"{'mean len':>8} {'decode':>7}  same as none",
    ]
    for workload, data in results.items():
        for name, r in data["drafters"].items():
            lines.append(
                f"{workload:<8} {name:<8} {r['tokens']:>6} {r['tokens_per_second']:>7.1f} "
                f"{r['speedup']:>7.2f}x "
                f"{r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f} {r['decode_speedup']:>6.2f}x"
                f"  {r['identical_to_none']}"
            )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    model = load_model(args.model or default_model_path(), args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
    results = run(model, args.drafters.split(","), draft_model, args.repeats, args.max_tokens)
    print(json.dumps(results, indent=2) if args.json else render(results))
    identical = all(r["identical_to_none"] for w in results.values() for r in w["drafters"].values())
    return 0 if identical else 1
