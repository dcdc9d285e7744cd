"""What tracing costs a single stream, measured side by side in one run.

Two pipelines run at once, identical but for telemetry: one with the default (spans and
metrics to OTLP/JSON files, every draft, verify and audit step traced), one with
`OTEL_SDK_DISABLED=true`. The same requests go to one, then the other (the order flips
each repeat), one at a time, so both see the same machine; figures are medians of the
client-side tokens/s and the ratio is traced over untraced (target: at least 0.97).
Both must produce the same tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

from pipeline.bench.common import WORKLOADS, running_pipeline, same_output, via_pipeline
from pipeline.bench.common import progress as common_progress
from pipeline.bench.flags import add_common_flags
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import Client

TARGET = 0.97
SIDES = ("traced", "untraced")


progress = functools.partial(common_progress, "tracing")


def measure(clients: dict[str, Client], drafters: list[str], repeats: int, params: SamplingParams) -> dict:
    runs: dict = {w: {d: {side: [] for side in SIDES} for d in drafters} for w in WORKLOADS}
    for client in clients.values():
        via_pipeline(client, "Hello.", SamplingParams(max_tokens=16, ignore_eos=True), "none")  # warm up
    for repeat in range(repeats):
        progress(f"repeat {repeat + 1}/{repeats}")
        for workload, text in WORKLOADS.items():
            for drafter in drafters:
                for side in sorted(SIDES, reverse=bool(repeat % 2)):
                    time.sleep(0.1)
                    runs[workload][drafter][side].append(via_pipeline(clients[side], text, params, drafter))
    return runs


def summarise(runs: dict) -> dict:
    rows = {}
    for workload, by_drafter in runs.items():
        for drafter, sides in by_drafter.items():
            traced, untraced = (statistics.median(r["tokens_per_second"] for r in sides[s]) for s in SIDES)
            first = sides["untraced"][0]
            rows[f"{workload}/{drafter}"] = {
                "tokens": len(first["tokens"]),
                "traced_tokens_per_second": traced,
                "untraced_tokens_per_second": untraced,
                "ratio": traced / untraced,
                "identical": all(same_output(r, first) for s in SIDES for r in sides[s]),
            }
    ratios = [row["ratio"] for row in rows.values()]
    return {"rows": rows, "median_ratio": statistics.median(ratios), "target": TARGET}


def render(summary: dict) -> str:
    lines = [
        "| workload/drafter | tokens | traced tok/s | untraced tok/s | ratio | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary["rows"].items():
        lines.append(
            f"| {name} | {row['tokens']} | {row['traced_tokens_per_second']:.1f} | "
            f"{row['untraced_tokens_per_second']:.1f} | {row['ratio']:.3f} | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    lines.append(
        f"\nMedian ratio traced/untraced: {summary['median_ratio']:.3f} "
        f"(overhead {100 * (1 - summary['median_ratio']):.1f}%; target at most {100 * (1 - TARGET):.0f}%)"
    )
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench tracing` and its flags."""
    parser = sub.add_parser(
        "tracing", help="a traced pipeline vs one with OTEL_SDK_DISABLED, single stream, side by side"
    )
    add_common_flags(parser, repeats=3)
    parser.add_argument("--drafters", default="none,ngram", help="comma-separated drafters, side by side")
    parser.add_argument("--max-tokens", type=int, default=128, help="per request (EOS ignored)")


def main(args: argparse.Namespace) -> int:
    drafters = args.drafters.split(",")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    settings = [f"model.path={args.model}"] if args.model else []
    traced_env = {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp_json_file"}
    traced_env["OTEL_METRICS_EXPORTER"] = "otlp_json_file"
    with (
        running_pipeline(settings, traced_env) as traced,
        running_pipeline(settings, {"OTEL_SDK_DISABLED": "true"}) as untraced,
        Client(traced.addresses.client, timeout=60.0) as traced_client,
        Client(untraced.addresses.client, timeout=60.0) as untraced_client,
    ):
        runs = measure({"traced": traced_client, "untraced": untraced_client}, drafters, args.repeats, params)
    summary = summarise(runs)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0 if all(row["identical"] for row in summary["rows"].values()) else 1
