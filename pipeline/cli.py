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


def _add_backend_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", default="auto", metavar="NAME",
        help="auto (default: native where it runs, else numpy), native, torch, numpy, or a key (torch:bf16)",
    )  # fmt: skip


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="pipeline configuration (TOML; see ops/speclanes.toml)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one setting"
    )


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    start = sub.add_parser("start", help="start the pipeline (lanes, orchestrator) under a supervisor")
    _add_config_flags(start)
    start.add_argument("--detach", action="store_true", help="run in the background; return once it is ready")
    start.add_argument(
        "--wait", type=float, default=120.0, help="with --detach: seconds to wait for readiness"
    )
    stop = sub.add_parser("stop", help="stop a pipeline started with `speclanes start`")
    _add_config_flags(stop)
    status = sub.add_parser("status", help="lanes, pids, restarts, active requests, speculation totals")
    _add_config_flags(status)
    status.add_argument("--connect", metavar="ADDR", help="orchestrator address (default: from the config)")
    status.add_argument("--json", action="store_true")
    stream = sub.add_parser("stream", help="stream a completion from a running pipeline")
    _add_config_flags(stream)
    stream.add_argument("--connect", metavar="ADDR", help="orchestrator address (default: from the config)")
    stream.add_argument("--drafter", choices=DRAFTERS, default=None, help="default: the pipeline's")
    stream.add_argument(
        "--k", default=None, help="draft tokens per step: 0-32 or auto (default: the pipeline's)"
    )
    stream.add_argument("--max-iterations", type=int, default=None)
    stream.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the pipeline to be ready"
    )
    _add_sampling_flags(stream)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speclanes", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate in-process and stream the text")
    gen.add_argument("--model", metavar="PATH", help="a llama-family GGUF (default: SmolLM2-135M-Instruct)")
    _add_backend_flag(gen)
    gen.add_argument(
        "--drafter", choices=DRAFTERS, default="none", help="speculation drafter (default: none)"
    )
    gen.add_argument(
        "--draft-model", metavar="PATH", help="smaller GGUF with the same vocabulary (--drafter model)"
    )
    gen.add_argument("--k", default="auto", help="draft tokens per step: a number 0-32, or auto (default)")
    gen.add_argument("--max-iterations", type=int, default=None, help="end the request after this many steps")
    _add_sampling_flags(gen)
    _add_pipeline_commands(sub)
    bench = sub.add_parser("bench", help="benchmarks (print ratios measured side by side)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    model_bench = bench_sub.add_parser("model", help="forward cost by block size vs the memory floor")
    model_bench.add_argument("--model", metavar="PATH")
    model_bench.add_argument(
        "--backends", default="native,torch,numpy", help="backends side by side (first: the subject)"
    )
    model_bench.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    model_bench.add_argument("--repeats", type=int, default=15)
    model_bench.add_argument("--json", action="store_true")
    model_bench.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's row")
    spec_bench = bench_sub.add_parser(
        "speculative", help="every drafter vs plain decoding on three workloads"
    )
    spec_bench.add_argument("--model", metavar="PATH")
    _add_backend_flag(spec_bench)
    spec_bench.add_argument(
        "--draft-model", metavar="PATH", help="for the model drafter (default: the target)"
    )
    spec_bench.add_argument("--drafters", default="none,ngram,suffix,auto,model")
    spec_bench.add_argument("--repeats", type=int, default=3)
    spec_bench.add_argument("--max-tokens", type=int, default=128)
    spec_bench.add_argument("--json", action="store_true")
    pipe_bench = bench_sub.add_parser(
        "pipeline", help="pipeline vs in-process tokens/s, and 1 vs N concurrent clients"
    )
    pipe_bench.add_argument("--model", metavar="PATH")
    pipe_bench.add_argument("--drafters", default="none,ngram,auto", help="single-stream drafters")
    pipe_bench.add_argument("--repeats", type=int, default=3)
    pipe_bench.add_argument("--max-tokens", type=int, default=128, help="single stream (EOS ignored)")
    pipe_bench.add_argument("--load-drafters", default="none,auto")
    pipe_bench.add_argument("--clients", type=int, default=8, help="concurrent clients in the load test")
    pipe_bench.add_argument("--load-tokens", type=int, default=80, help="new tokens per load request")
    pipe_bench.add_argument("--load-repeats", type=int, default=2)
    pipe_bench.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for the bench's pipelines"
    )
    pipe_bench.add_argument("--json", action="store_true")
    tracing_bench = bench_sub.add_parser(
        "tracing", help="a traced pipeline vs one with OTEL_SDK_DISABLED, single stream, side by side"
    )
    tracing_bench.add_argument("--model", metavar="PATH")
    tracing_bench.add_argument("--drafters", default="none,ngram")
    tracing_bench.add_argument("--repeats", type=int, default=3)
    tracing_bench.add_argument("--max-tokens", type=int, default=128, help="per request (EOS ignored)")
    tracing_bench.add_argument("--json", action="store_true")
    peers_bench = bench_sub.add_parser(
        "peers", help="speclanes vs transformers and llama-cpp-python (ops/bench/install_peers.sh)"
    )
    peers_bench.add_argument("--model", metavar="PATH")
    peers_bench.add_argument("--peers", default="hf,llama_cpp", help="peers to run (skipped if missing)")
    peers_bench.add_argument("--drafters", default="none,ngram,auto", help="speclanes drafters")
    peers_bench.add_argument("--no-pipeline", action="store_true", help="speclanes in-process rows only")
    peers_bench.add_argument("--repeats", type=int, default=3)
    peers_bench.add_argument("--max-tokens", type=int, default=128, help="new tokens (EOS ignored)")
    peers_bench.add_argument("--lookup-tokens", type=int, default=10, help="peers' prompt-lookup drafts")
    peers_bench.add_argument(
        "--output", default="ops/bench/peers.md", help="table file; the chart goes next to it ('-': none)"
    )
    peers_bench.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for the bench's pipelines"
    )
    peers_bench.add_argument("--json", action="store_true")
    from .audit_cli import add_parser as add_audit_parser

    add_audit_parser(sub, _add_config_flags)
    trace = sub.add_parser("trace", help="read the telemetry file export: list traces, or show one as a tree")
    _add_config_flags(trace)
    trace.add_argument("request", nargs="?", help="a request id or trace id (default: list the traces)")
    trace.add_argument("--dir", help="telemetry directory (default: telemetry.dir from the config)")
    trace.add_argument("--json", action="store_true")
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


def load_model(path: str | None, backend: str = "auto"):
    from .model import default_model_path
    from .model import load_model as load

    return load(path or default_model_path(), backend)


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
    model = load_model(args.model, args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
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


def _config(args: argparse.Namespace):
    from .config import load_config

    return load_config(args.config, args.set)


def cmd_start(args: argparse.Namespace) -> int:
    import os
    import subprocess
    from pathlib import Path

    from .client import Client
    from .supervisor import pid_file, supervise
    from .telemetry import check

    config = _config(args)
    check()  # an OTEL_* setting no process could honour fails here, not in a restart loop
    if not args.detach:
        supervise(config)
        return 0
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pipeline.cli", "start"]
    command += ["--config", os.path.abspath(args.config)] if args.config else []
    command += [f"--set={item}" for item in args.set]
    with (run_dir / "supervisor.log").open("ab") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    client = Client(config.addresses.client, timeout=2.0)
    try:
        client.wait_ready(args.wait)
    except Exception:
        proc.terminate()
        raise
    print(
        f"speclanes: pipeline up (supervisor pid {proc.pid}; logs in {run_dir}; pid file {pid_file(config)})"
    )
    if "gateway" in config.processes():
        url = f"http://{config.gateway.host}:{config.gateway.port}/v1"
        print(f"speclanes: OpenAI-compatible API at {url} (model {config.model_id()})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    import os
    import signal
    import time

    from .supervisor import pid_file

    path = pid_file(_config(args))
    try:
        pid = int(path.read_text())
    except (OSError, ValueError):
        raise ValueError(f"no running pipeline (no pid file at {path})") from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        raise ValueError(f"the supervisor (pid {pid}) is not running; removed its stale pid file") from None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"speclanes: stopped (supervisor pid {pid})")
            return 0
        time.sleep(0.1)
    raise ValueError(f"the supervisor (pid {pid}) did not stop within 30 s")


def cmd_status(args: argparse.Namespace) -> int:
    from .client import Client

    config = _config(args)
    report = Client(args.connect or config.addresses.client, timeout=5.0).status()
    if args.json:
        data = msgspec.to_builtins(report)
        for lane, status in zip(data["lanes"], report.lanes, strict=True):
            lane["totals"]["acceptance"] = status.totals.acceptance
        data["totals"]["acceptance"] = report.totals.acceptance
        print(msgspec.json.encode(data).decode())
        return 0
    print(f"{'lane':<13}{'state':<10}{'pid':>8}{'restarts':>10}{'active':>8}{'drafted':>10}{'accepted':>10}")
    for lane in report.lanes:
        t = lane.totals
        print(
            f"{lane.name:<13}{lane.state:<10}{lane.pid or '-':>8}{lane.restarts:>10}{lane.active_requests:>8}"
            f"{t.drafted:>10}{t.accepted:>10}"
        )
    t = report.totals
    print(
        f"requests: {report.active_requests} active, {t.runs} finished; acceptance {t.acceptance:.2f}; "
        f"audit events pending: {report.audit_pending}; faults: {len(report.faults)}"
    )
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    from .client import Client
    from .prompts import load_messages

    params = _sampling(args)
    k = parse_k(args.k) if args.k is not None else None
    messages = load_messages(args.messages) if args.messages else None
    if messages is not None and args.prompt is not None:
        raise ValueError("give either a PROMPT or --messages, not both")
    config = _config(args)
    with Client(args.connect or config.addresses.client) as client:
        client.wait_ready(args.wait)
        submitted = client.submit(
            args.prompt, messages=messages, chat=args.chat, params=params,
            drafter=args.drafter, k=k, max_iterations=args.max_iterations,
        )  # fmt: skip
        for item in client.chunks(submitted.request_id):
            if isinstance(item, dict):
                if "error" in item:
                    raise ValueError(f"request {item['request_id']} failed: {item['error']['message']}")
                sys.stdout.write(msgspec.json.encode(item).decode() + "\n" if args.json else "\n")
            elif not args.json:
                sys.stdout.write(item.text)
                sys.stdout.flush()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import model_bench, peers_bench, pipeline_bench, speculative_bench, tracing_bench

    benches = {
        "model": model_bench,
        "speculative": speculative_bench,
        "pipeline": pipeline_bench,
        "peers": peers_bench,
        "tracing": tracing_bench,
    }
    return benches[args.bench].main(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .trace_files import find_trace, read_spans, render_tree, summary_rows, trace_files

    directory = Path(args.dir or _config(args).telemetry.dir)
    files = trace_files(directory)
    if not files:
        raise ValueError(f"no trace files in {directory} (is OTEL_TRACES_EXPORTER sending them elsewhere?)")
    spans, bad = read_spans(files)
    if bad:
        print(f"speclanes: skipped {bad} unreadable line(s): a process killed while writing", file=sys.stderr)
    if args.request is None:
        rows = summary_rows(spans)
        if args.json:
            print(msgspec.json.encode(rows).decode())
            return 0
        print(f"{'request':<34}{'trace':<34}{'spans':>6}{'seconds':>9}{'tokens':>8}{'errors':>8}  services")
        for row in rows:
            print(
                f"{row['request_id']:<34}{row['trace_id']:<34}{row['spans']:>6}{row['seconds']:>9.2f}"
                f"{row['output_tokens']:>8}{row['errors']:>8}  {','.join(row['services'])}"
            )
        return 0
    trace = find_trace(spans, args.request)
    if not trace:
        raise ValueError(f"no trace for {args.request!r} in {directory}")
    print(msgspec.json.encode(trace).decode() if args.json else render_tree(trace))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from . import audit_cli

    return audit_cli.main(args)


def main(argv: Sequence[str] | None = None) -> int:
    from .model import BackendUnavailable, ModelFileError

    args = build_parser().parse_args(argv)
    from .client import PipelineError

    handlers = {
        "generate": cmd_generate,
        "bench": cmd_bench,
        "start": cmd_start,
        "stop": cmd_stop,
        "status": cmd_status,
        "stream": cmd_stream,
        "audit": cmd_audit,
        "trace": cmd_trace,
    }
    try:
        return handlers[args.command](args)
    except BrokenPipeError:  # `speclanes ... | head`: the reader has all it wanted
        sys.stderr.close()  # and Python's exit-time flush of stdout must not complain either
        return 0
    except (ModelFileError, BackendUnavailable, ValueError, PipelineError, OSError) as exc:
        print(f"speclanes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
