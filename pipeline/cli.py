"""The `speclanes` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from .drafters.registry import DRAFTERS


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (raw, unless --chat)")
    p.add_argument(
        "--messages", metavar="FILE", help='JSON list of {"role", "content"} for the chat template'
    )
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object at the end instead of streaming"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speclanes", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate in-process and stream the text")
    gen.add_argument("--model", metavar="PATH", help="a llama-family GGUF (default: SmolLM2-135M-Instruct)")
    gen.add_argument(
        "--drafter", choices=DRAFTERS, default="none", help="speculation drafter (default: none)"
    )
    gen.add_argument(
        "--draft-model", metavar="PATH", help="smaller GGUF with the same vocabulary (--drafter model)"
    )
    gen.add_argument("--k", default="auto", help="draft tokens per step: a number 0-32, or auto (default)")
    gen.add_argument("--max-iterations", type=int, default=None, help="end the request after this many steps")
    _add_sampling_flags(gen)
    bench = sub.add_parser("bench", help="benchmarks (print ratios measured side by side)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    model_bench = bench_sub.add_parser("model", help="forward cost by block size vs the memory floor")
    model_bench.add_argument("--model", metavar="PATH")
    model_bench.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    model_bench.add_argument("--repeats", type=int, default=15)
    model_bench.add_argument("--json", action="store_true")
    spec_bench = bench_sub.add_parser(
        "speculative", help="every drafter vs plain decoding on three workloads"
    )
    spec_bench.add_argument("--model", metavar="PATH")
    spec_bench.add_argument(
        "--draft-model", metavar="PATH", help="for the model drafter (default: the target)"
    )
    spec_bench.add_argument("--drafters", default="none,ngram,suffix,auto,model")
    spec_bench.add_argument("--repeats", type=int, default=3)
    spec_bench.add_argument("--max-tokens", type=int, default=128)
    spec_bench.add_argument("--json", action="store_true")
    return parser


def _sampling(args: argparse.Namespace):
    from .sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def load_model(path: str | None):
    from .model import Model, default_model_path

    return Model.load(path or default_model_path())


def parse_k(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"--k takes a number from 0 to 32 or 'auto', got {text!r}") from None
    if not 0 <= k <= 32:
        raise ValueError(f"--k takes a number from 0 to 32 or 'auto', got {k}")
    return k


def cmd_generate(args: argparse.Namespace) -> int:
    from .drafters.registry import make_draft_source
    from .prompts import load_messages, prompt_tokens
    from .speculative import decode

    params = _sampling(args)
    k = parse_k(args.k)
    if args.max_iterations is not None and args.max_iterations < 1:
        raise ValueError("--max-iterations must be >= 1")
    messages = load_messages(args.messages) if args.messages else None
    model = load_model(args.model)
    draft_model = load_model(args.draft_model) if args.draft_model else None
    source = make_draft_source(args.drafter, model, draft_model)
    assert model.tokenizer is not None
    prompt = prompt_tokens(model.tokenizer, args.prompt, chat=args.chat, messages=messages)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    completion = decode(
        model,
        prompt,
        params,
        source,
        k=0 if args.drafter == "none" else k,
        max_iterations=args.max_iterations,
        on_text=None if args.json else show,
    )
    if args.json:
        sys.stdout.write(msgspec.json.encode(completion).decode() + "\n")
    else:
        sys.stdout.write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import model_bench, speculative_bench

    return {"model": model_bench, "speculative": speculative_bench}[args.bench].main(args)


def main(argv: Sequence[str] | None = None) -> int:
    from .model import ModelFileError

    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except (ModelFileError, ValueError) as exc:
        print(f"speclanes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
