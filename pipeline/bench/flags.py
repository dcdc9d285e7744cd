"""Flags that several commands share (the CLI's `generate` too); kept free of heavy imports,
so building the command line stays fast."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """A count of runs: a median of no runs is no figure, so 0 is refused at the command line."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_backend_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default="auto", metavar="NAME",
        help="auto (default: native where it runs, else numpy), native, torch, numpy, or a key (torch:bf16)",
    )  # fmt: skip


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for the bench's pipelines"
    )


def add_common_flags(parser: argparse.ArgumentParser, repeats: int) -> None:
    """--model, --repeats and --json, which every benchmark takes."""
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="the target GGUF, or a packaged model: gemma3-270m (default: the SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--repeats",
        type=at_least_one,
        default=repeats,
        help=f"runs per figure, the median shown (default {repeats})",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
