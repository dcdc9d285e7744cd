"""Structured output with and without speculation: JSON workloads (`json_object` and three schemas
of `schemas.py`), every drafter against plain constrained decoding, side by side in one run.

As in `bench speculative`: runs are interleaved (each repeat goes through every drafter in turn), the
figures are medians, each run starts a fresh draft source. A grammar changes what speculation
earns: the tokens it forces (separators, keys, closing brackets) are drafted for free by every
drafter, even `none`-like ones, and a draft it forbids is cut before the forward. `free` is
unconstrained plain decoding of the same prompt: how fast the model goes without the grammar's masks
(its output is other text, so its row is only a speed reference).

Every constrained output must equal plain constrained decoding's token for token (greedy, and
seeded with the deterministic drafters), and an output that ends by itself must parse as JSON that
validates (with `jsonschema` when it is installed); the exit status is 1 if one does not. One cut by
max_tokens is reported as such (`json_object` cannot be bounded; the schemas are, by
`schemas.bounded`, so a sampled small model cannot write one string until max_tokens). `cpu` is the
speed-up in this process's CPU seconds per token: on a shared machine the wall-clock figures also
measure the neighbours' load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.bench.common import (
    chat_prompt,
    load_note,
    machine_header,
    progress,
    render_header,
    result_decode_rate,
)
from pipeline.bench.flags import add_backend_flag, add_common_flags
from pipeline.bench.schemas import ORDER, PERSON, TOOL_CALL, bounded
from pipeline.bench.speculative_bench import identity_expected, run_one
from pipeline.decoding.grammar.format import canonical_response_format
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Runtime as Model
from pipeline.model import load_model
from pipeline.model.calibration import row_seconds
from pipeline.model.default import model_path

WORKLOADS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "object": ('Give me a JSON object with the keys "city", "country" and "population" for Paris.', None),
    "person": ("Describe Ada Lovelace as JSON.", PERSON),
    "order": ("Write an example online order as JSON.", ORDER),
    "tool": ("What is the weather in Paris? Answer with a tool call.", TOOL_CALL),
}
FREE = "free"  # plain decoding without the format: the speed reference


def response_format(name: str, schema: dict[str, Any] | None) -> str | None:
    if schema is None:
        return canonical_response_format({"type": "json_object"})
    return canonical_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})


def json_problem(result: Result, schema: dict[str, Any] | None) -> str | None:
    """Why an output is not a finished, valid document, if it is not."""
    if result.finish_reason != "stop":
        return f"ended by {result.finish_reason}"
    try:
        document = json.loads(result.text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        import jsonschema  # a test dependency: validated when it is there
    except ImportError:
        return None if isinstance(document, dict) else "not an object"
    try:
        jsonschema.validate(document, schema or {"type": "object"})
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return None


def run(model: Model, drafters: list[str], repeats: int, params: SamplingParams) -> dict:
    results: dict = {}
    for workload, (text, schema) in WORKLOADS.items():
        schema = None if schema is None else bounded(schema)
        prompt = chat_prompt(model, text)
        constrained = msgspec.structs.replace(params, response_format=response_format(workload, schema))
        runs: dict[str, list[Timed]] = {name: [] for name in [FREE, *drafters]}
        for _ in range(repeats):
            runs[FREE].append(timed(model, prompt, params, "none"))
            for name in drafters:
                runs[name].append(timed(model, prompt, constrained, name))
        progress("structured", f"{workload} done (temperature {params.temperature}, load {load_note()})")
        results[workload] = {
            "prompt_tokens": len(prompt),
            "drafters": {
                name: figures(name, done, runs["none"], schema, params) for name, done in runs.items()
            },
        }
    return results


@dataclass(frozen=True)
class Timed:
    result: Result
    cpu_per_token: float  # this process's CPU seconds (every thread) per generated token


def timed(model: Model, prompt: list[int], params: SamplingParams, name: str) -> Timed:
    start = time.process_time()
    result = run_one(model, prompt, params, name, None)
    return Timed(result, (time.process_time() - start) / max(len(result.tokens), 1))


def figures(
    name: str,
    runs: list[Timed],
    base_runs: list[Timed],
    schema: dict[str, Any] | None,
    params: SamplingParams,
) -> dict[str, Any]:
    """One drafter's row: medians over the repeats, against plain constrained decoding (`base`). The
    CPU figure is the ratio of CPU seconds per token: on a machine shared with other work, wall time
    also measures the neighbours, the CPU this process spent much less so."""
    completions, base = [t.result for t in runs], [t.result for t in base_runs]
    tps = statistics.median(r.stats.tokens_per_second for r in completions)
    decode = statistics.median(result_decode_rate(r) for r in completions)
    cpu = statistics.median(t.cpu_per_token for t in base_runs) / statistics.median(
        t.cpu_per_token for t in runs
    )
    last, free = completions[-1], name == FREE
    return {
        "tokens": len(last.tokens), "tokens_per_second": tps,
        "speedup": tps / statistics.median(r.stats.tokens_per_second for r in base),
        "decode_speedup": decode / statistics.median(result_decode_rate(r) for r in base), "cpu_speedup": cpu,
        "acceptance_rate": last.stats.acceptance_rate, "nodes_per_step": last.stats.nodes_per_step,
        "mean_accepted_length": last.stats.mean_accepted_length,
        "identical_to_none": None if free else all(r.tokens == base[0].tokens for r in completions),
        "identity_expected": not free and identity_expected(name, params, None),
        "json_problem": None if free else json_problem(last, schema),
    }  # fmt: skip


def render(results: dict) -> str:
    lines = [
        f"{'workload':<8} {'drafter':<8} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} {'accept':>7} "
        f"{'mean len':>8} {'nodes':>6} {'decode':>7} {'cpu':>7}  same as none  valid JSON",
    ]
    for workload, data in results.items():
        for name, r in data["drafters"].items():
            same = str(r["identical_to_none"]) if r["identity_expected"] else "n/a"
            valid = "" if name == FREE else r["json_problem"] or "yes"
            lines.append(
                f"{workload:<8} {name:<8} {r['tokens']:>6} {r['tokens_per_second']:>7.1f} "
                f"{r['speedup']:>7.2f}x {r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f} "
                f"{r['nodes_per_step']:>6.2f} {r['decode_speedup']:>6.2f}x {r['cpu_speedup']:>6.2f}x"
                f"  {same:<12}  {valid}"
            )
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench structured` and its flags."""
    parser = sub.add_parser("structured", help="JSON output (response_format) with and without speculation")
    add_common_flags(parser, repeats=3)
    add_backend_flag(parser)
    parser.add_argument(
        "--drafters", default="none,ngram,suffix,auto", help="comma-separated, as `bench speculative` takes"
    )
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens generated per run at most")
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="the seeded section's temperature (0: leave it out)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="the seeded section's seed (default 1234)")


def main(args: argparse.Namespace) -> int:
    model = load_model(model_path(args.model), args.backend)
    sections = {"greedy": SamplingParams(max_tokens=args.max_tokens)}
    if args.temperature > 0:
        sections["seeded"] = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
    curve = row_seconds(model)  # calibrated before any timed run, as a lane does at start
    header = machine_header(model, curve)
    drafters = args.drafters.split(",")
    if "none" not in drafters:
        drafters.insert(0, "none")  # the baseline every row is compared with
    results = {name: run(model, drafters, args.repeats, params) for name, params in sections.items()}
    header["load_after"] = load_note()
    if args.json:
        print(json.dumps({"machine": header, "sections": results}, indent=2))
    else:
        print(render_header(header))
        for name, params in sections.items():
            print(f"\n{name}: temperature={params.temperature} seed={params.seed}")
            print(render(results[name]))
    rows = [r for s in results.values() for w in s.values() for n, r in w["drafters"].items() if n != FREE]
    identical = all(r["identical_to_none"] for r in rows if r["identity_expected"])
    # An output cut by max_tokens is reported, not failed: only a finished output must be valid.
    valid = all(r["json_problem"] is None or r["json_problem"].startswith("ended by") for r in rows)
    return 0 if identical and valid else 1
