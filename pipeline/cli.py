"""The `speclanes` command line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from pipeline import __version__
from pipeline.decoding.drafters.kinds import DRAFTERS
from pipeline.decoding.speculation import Speculation, SpeculationError

DEFAULT_DRAFTER = Speculation().drafter  # one policy for `generate`, `stream` and the pipeline


def _bench(name: str) -> Callable[[], ModuleType]:
    return lambda: importlib.import_module(f"pipeline.bench.{name}")


# Each benchmark module declares its flags (`add_parser`) and runs from `main(args)`.
BENCHES = {
    "model": _bench("model_bench"),
    "speculative": _bench("speculative_bench"),
    "structured": _bench("structured_bench"),
    "pipeline": _bench("pipeline_bench"),
    "peers": _bench("peers_bench"),
    "tracing": _bench("tracing_bench"),
}


def _add_response_format_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--response-format",
        metavar="JSON",
        help="structured output, as OpenAI's response_format: "
        '{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} '
        'or {"type": "grammar", "grammar": LARK_OR_GBNF}; @FILE reads it from a file',
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (raw, unless --chat)")
    p.add_argument(
        "--messages", metavar="FILE", help='JSON list of {"role", "content"} for the chat template'
    )
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens; 0 disables top-k")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="keep the likeliest tokens up to this mass; 1 disables it"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="makes a sampled run reproducible (default: a random seed)"
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object at the end instead of streaming"
    )
    p.add_argument(
        "--logprobs", type=int, default=None, metavar="N",
        help="with --json: each token's log-probability and the N likeliest alternatives (0-20)",
    )  # fmt: skip
    _add_control_flags(p)


def _add_control_flags(p: argparse.ArgumentParser) -> None:
    """The sampling controls, as the OpenAI API and vLLM name them (`decoding.controls`)."""
    p.add_argument(
        "--min-p", type=float, default=0.0,
        help="keep only tokens at least this fraction as likely as the most likely one (0-1; 0 disables)",
    )  # fmt: skip
    p.add_argument(
        "--presence-penalty", type=float, default=0.0,
        help="subtract this from the logit of every token already generated (-2 to 2)",
    )  # fmt: skip
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0,
        help="subtract this times the number of times a token was generated (-2 to 2)",
    )  # fmt: skip
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="divide positive (multiply negative) logits of tokens in the prompt or output (> 0; 1 disables)",
    )  # fmt: skip
    p.add_argument(
        "--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
        help="add BIAS (-100 to 100; -100 bans the token) to token id TOKEN's logit (repeatable)",
    )  # fmt: skip
    _add_response_format_flag(p)


def _add_backend_flag(p: argparse.ArgumentParser) -> None:
    from pipeline.bench.flags import add_backend_flag

    add_backend_flag(p)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="pipeline configuration (TOML; see ops/speclanes.toml)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one setting"
    )


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's and vLLM's spellings for what `--set` sets (they win over --set and --config)."""
    p.add_argument(
        "-m", "--model", metavar="PATH",
        help="the target GGUF, or a packaged model: gemma3-270m (as --set model.path=PATH)",
    )  # fmt: skip
    p.add_argument("--host", help="the HTTP API's address (as --set gateway.host=HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the HTTP API's port (as --set gateway.port=PORT; default 8000)")
    p.add_argument(
        "--alias", "--served-model-name", dest="alias", metavar="NAME",
        help="the model id clients name (as --set gateway.model=NAME; default: the GGUF's file name)",
    )  # fmt: skip


def serving_settings(args: argparse.Namespace) -> list[str]:
    """--set entries for the serving flags given, after the user's own (the last one wins)."""
    settings = list(args.set)
    if args.model is not None:
        from pipeline.model.default import PACKAGED, model_path
        from pipeline.model.errors import ModelFileError

        try:  # a packaged model's name is its (assembled) file
            model = model_path(args.model) if args.model in PACKAGED else Path(args.model).expanduser()
        except ModelFileError as exc:
            raise ValueError(f"--model {args.model}: {exc}") from None
        if not model.is_file():
            raise ValueError(f"--model {args.model}: no such file")
        settings.append(f"model.path={model.resolve()}")
    flags = {"gateway.host": args.host, "gateway.port": args.port, "gateway.model": args.alias}
    return settings + [f"{key}={value}" for key, value in flags.items() if value is not None]


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    start = sub.add_parser("start", help="start the pipeline (lanes, orchestrator) under a supervisor")
    _add_config_flags(start)
    _add_serving_flags(start)
    start.add_argument("--detach", action="store_true", help="run in the background; return once it is ready")
    start.add_argument(
        "--wait", type=float, default=120.0, help="with --detach: seconds to wait for readiness"
    )
    stop = sub.add_parser(
        "stop", help="stop a pipeline started with `speclanes start`: in-flight requests finish first"
    )
    _add_config_flags(stop)
    stop.add_argument(
        "--now", action="store_true",
        help="stop at once (SIGINT) instead of draining; the next start resumes in-flight requests",
    )  # fmt: skip
    status = sub.add_parser(
        "status",
        help="lanes, pids, restarts, active requests, speculation totals, the verify lane's time by phase",
    )
    _add_config_flags(status)
    status.add_argument("--connect", metavar="ADDR", help="orchestrator address (default: from the config)")
    status.add_argument(
        "--json", action="store_true", help="the orchestrator's whole report and the health verdict, as JSON"
    )
    stream = sub.add_parser("stream", help="stream a completion from a running pipeline")
    _add_config_flags(stream)
    stream.add_argument("--connect", metavar="ADDR", help="orchestrator address (default: from the config)")
    stream.add_argument("--drafter", choices=DRAFTERS, default=None, help="default: the pipeline's")
    stream.add_argument(
        "--k", default=None, help="draft tokens per step: 0-32 or auto (default: the pipeline's)"
    )
    stream.add_argument(
        "--max-iterations", type=int, default=None, help="end the request after this many verify steps"
    )
    stream.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the pipeline to be ready"
    )
    _add_sampling_flags(stream)


def _add_certs_command(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="certificates for mutual TLS between hosts (tls+tcp:// addresses)")
    certs_sub = certs.add_subparsers(dest="certs", required=True)
    make = certs_sub.add_parser(
        "make", help="a CA (kept if DIR has one) and a certificate and key per host, into DIR"
    )
    make.add_argument("dir", metavar="DIR", help="where the files go (created 0700)")
    make.add_argument(
        "--hosts", required=True, help="comma-separated names or IP addresses, as peers dial them"
    )
    from pipeline.service.certs import DEFAULT_DAYS  # no cryptography import until a command runs

    make.add_argument("--days", type=int, default=DEFAULT_DAYS, help="how long the certificates are valid")


def _add_cache_command(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="the prepared-weight and kernel cache ($SPECLANES_CACHE)")
    cache_sub = cache.add_subparsers(dest="cache", required=True)
    cache_sub.add_parser("verify", help="hash every entry against its seal; exit 1 if any is damaged")
    cache_sub.add_parser("clear", help="remove every entry (each is rebuilt when next needed)")


def build_parser(with_benches: bool = True) -> argparse.ArgumentParser:
    """`with_benches=False` leaves the benchmarks' own flags out: importing them costs ~0.1 s."""
    parser = argparse.ArgumentParser(prog="speclanes", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=f"speclanes {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate in-process and stream the text")
    gen.add_argument(
        "-m",
        "--model",
        metavar="PATH",
        help="a GGUF file, or a packaged model: gemma3-270m (default: SmolLM2-135M-Instruct)",
    )
    _add_backend_flag(gen)
    gen.add_argument(
        "--drafter", choices=DRAFTERS, default=None, help=f"speculation drafter (default: {DEFAULT_DRAFTER}, "
        "as in the pipeline: the same output, and plain decoding whenever drafts do not pay)",
    )  # fmt: skip
    gen.add_argument(
        "--draft-model", metavar="PATH", help="smaller GGUF with the same vocabulary (--drafter model)"
    )
    gen.add_argument(
        "--draft-head", metavar="PATH",
        help="a draft head for --drafter learned and auto (default: the one found for the model)",
    )  # fmt: skip
    gen.add_argument("--k", default="auto", help="draft tokens per step: a number 0-32, or auto (default)")
    gen.add_argument("--max-iterations", type=int, default=None, help="end the request after this many steps")
    gen.add_argument(
        "--linear", action="store_true", help="n-gram/suffix drafts as one chain a step, not a token tree"
    )
    _add_sampling_flags(gen)
    _add_pipeline_commands(sub)
    bench = sub.add_parser("bench", help="benchmarks (print ratios measured side by side)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for bench_module in BENCHES.values() if with_benches else ():
        bench_module().add_parser(bench_sub)
    from pipeline.audit.cli import add_parser as add_audit_parser

    add_audit_parser(sub, _add_config_flags)
    _add_certs_command(sub)
    _add_cache_command(sub)
    from pipeline.training.cli import add_parser as add_drafter_parser

    add_drafter_parser(sub)
    trace = sub.add_parser("trace", help="read the telemetry file export: list traces, or show one as a tree")
    _add_config_flags(trace)
    trace.add_argument(
        "request", nargs="?", help="a request, response (chatcmpl-...) or trace id, or a unique prefix "
        "(default: list the traces)",
    )  # fmt: skip
    trace.add_argument("--dir", help="telemetry directory (default: telemetry.dir from the config)")
    trace.add_argument("--json", action="store_true", help="the spans (or the list of traces) as JSON")
    return parser


def _sampling(args: argparse.Namespace):
    from pipeline.decoding.sampling import SamplingParams

    if args.logprobs is not None and not args.json:  # the entries are part of --json's object
        raise ValueError("--logprobs shows in the --json object: add --json")
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=logit_bias(args.logit_bias),
        response_format=response_format_arg(args.response_format),
        logprobs=args.logprobs,
    )


def result_json(result: Any) -> str:
    """`--json`'s object: the Result, with its log-probabilities (if asked for) as JSON objects."""
    from pipeline.decoding.logprobs import readable

    data = msgspec.to_builtins(result)
    if result.logprobs is not None:
        data["logprobs"] = readable(result.logprobs)
    return msgspec.json.encode(data).decode()


def logit_bias(pairs: list[str]) -> dict[int, float]:
    """--logit-bias TOKEN=BIAS flags as a dict (a token named twice keeps its last bias)."""
    bias: dict[int, float] = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:  # no "=", or either side not a number
            raise ValueError(f"--logit-bias takes TOKEN=BIAS (an id and a number), got {pair!r}") from None
    return bias


def response_format_arg(value: str | None) -> str | None:
    """--response-format: JSON text, or @FILE holding it, as the canonical text SamplingParams carries."""
    from pipeline.decoding.grammar.format import canonical_response_format

    if value is not None and value.startswith("@"):
        value = Path(value[1:]).read_text()
    return canonical_response_format(value)


def load_model(path: str | None, backend: str = "auto"):
    from pipeline.model import load_model as load
    from pipeline.model.default import model_path

    return load(model_path(path), backend)


def speculation_args(args: argparse.Namespace) -> Speculation:
    """--drafter, --k and --max-iterations, checked by `Speculation` (the one home of those rules);
    a flag left out takes Speculation's default here and the pipeline's in `stream`."""
    k = args.k
    if k not in (None, "auto"):
        try:
            k = int(k)
        except ValueError:
            raise ValueError(f"--k takes a number or 'auto', got {k!r}") from None
    try:
        return Speculation().overridden(drafter=args.drafter, k=k, max_iterations=args.max_iterations)
    except SpeculationError as exc:
        raise ValueError(f"--{exc.field.replace('_', '-')}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from pipeline.decoding.drafters.kinds import needs_head, parts
    from pipeline.decoding.drafters.registry import make_draft_source
    from pipeline.decoding.speculative import decode
    from pipeline.model.calibration import stored_row_seconds
    from pipeline.model.default import model_path
    from pipeline.model.draft_head import head_for
    from pipeline.model.prompts import load_messages, prompt_tokens

    params = _sampling(args)
    speculation = speculation_args(args)
    messages = load_messages(args.messages) if args.messages else None
    model = load_model(args.model, args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
    head = None  # loaded only for a drafter that drafts with one (0.35 s)
    if any(needs_head(p) for p in parts(speculation.drafter, draft_model=True, head=True)):
        head = head_for(model_path(args.model), model.cfg, model.embed, args.draft_head)
    source = make_draft_source(speculation.drafter, model, draft_model, head)
    assert model.tokenizer is not None
    prompt = prompt_tokens(model.tokenizer, args.prompt, chat=args.chat, messages=messages)
    if speculation.fixed_k is None:  # the controller's t(rows): the one a lane or an earlier run kept
        with contextlib.suppress(OSError):  # measured but not kept (a full disk): the next run measures
            stored_row_seconds(model, model_path(args.model))

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    completion = decode(
        model,
        prompt,
        params,
        source,
        k=speculation.fixed_k,
        max_iterations=speculation.max_iterations,
        tree=not args.linear,
        on_text=None if args.json else show,
    )
    if args.json:
        sys.stdout.write(result_json(completion) + "\n")
    else:
        sys.stdout.write("\n")
    return 0


def _config(args: argparse.Namespace):
    from pipeline.protocol.config import load_config

    return load_config(args.config, args.set)


def cmd_start(args: argparse.Namespace) -> int:
    from pipeline.observability.telemetry import check
    from pipeline.service.launch import launch
    from pipeline.service.run_dir import pid_path
    from pipeline.service.supervisor import supervise

    args.set = serving_settings(args)
    config = _config(args)
    check()  # an OTEL_* setting no process could honour fails here, not in a restart loop
    if not args.detach:
        failure, status = supervise(config)  # a lane failed, or a drain had to end requests
        if failure is not None:
            print(f"speclanes: error: {failure}", file=sys.stderr)
        return status
    proc, config = launch(args.set, config_path=args.config, timeout=args.wait)
    print(
        f"speclanes: pipeline up (supervisor pid {proc.pid}; logs in {config.run.dir}; "
        f"pid file {pid_path(Path(config.run.dir))})"
    )
    _say_failed(config)
    if "gateway" in config.processes():
        url = f"http://{config.gateway.host}:{config.gateway.port}/v1"
        print(f"speclanes: OpenAI-compatible API at {url} (model {config.model_id()})")
    return 0


def _say_failed(config) -> None:
    """Up, but degraded: name each lane that failed on its way up, with its reason."""
    from pipeline.protocol.client import Client

    with Client(config.addresses.client, timeout=5.0) as client:
        for lane in client.status().lanes:
            if lane.state == "failed":
                print(f"speclanes: degraded: the {lane.name} lane failed: {lane.reason}", file=sys.stderr)


def cmd_stop(args: argparse.Namespace) -> int:
    import os
    import signal
    import time

    from pipeline.service.run_dir import is_supervisor, running_supervisor

    run_dir = Path(_config(args).run.dir)
    pid = running_supervisor(run_dir)
    if pid is None:
        raise ValueError(f"no pipeline is running in {run_dir}")
    if not pid or not is_supervisor(pid):
        raise ValueError(
            f"{run_dir} is locked, but pid {pid} is not a speclanes supervisor of yours: not signalling"
        )
    config = _config(args)
    # SIGTERM drains (in-flight requests finish within shutdown.drain_seconds); SIGINT stops now
    os.kill(pid, signal.SIGINT if args.now else signal.SIGTERM)
    patience = 30 + (0 if args.now else config.shutdown.drain_seconds + config.shutdown.flush_seconds)
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if running_supervisor(run_dir) is None:
            print(f"speclanes: stopped (supervisor pid {pid})")
            return 0
        time.sleep(0.1)
    raise ValueError(f"the supervisor (pid {pid}) did not stop within {patience:g} s")


def require_running(config) -> None:
    """Nothing running here: say so at once rather than after a connection timeout."""
    from pipeline.service.run_dir import running_supervisor

    if running_supervisor(Path(config.run.dir)) is None:
        raise ValueError(f"no pipeline is running in {config.run.dir} (start one with `speclanes start`)")


def _client(args: argparse.Namespace, config, **kwargs: Any):
    """The orchestrator's client socket (--connect, else the config's), with the config's [tls]:
    a tls+tcp:// pipeline answers only a client that holds a certificate its CA signed."""
    from pipeline.protocol import address
    from pipeline.protocol.client import Client

    url = args.connect or config.addresses.client
    address.check("--connect", url, tls_files=config.tls.configured(), insecure_tcp=config.tls.insecure_tcp)
    return Client(url, tls=config.tls, max_message_bytes=config.admission.max_message_bytes, **kwargs)


def cmd_status(args: argparse.Namespace) -> int:
    from pipeline.api.health import judge
    from pipeline.workers.loop_phases import per_forward, render_split

    config = _config(args)
    if not args.connect:
        require_running(config)
    report = _client(args, config, timeout=5.0).status()
    health = judge(report.lanes, report.closing, report.storage)  # what the gateway's /health answers
    if args.json:
        data = msgspec.to_builtins(report) | {"health": health.body()}
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
    verify = report.lane("verify")
    if verify is not None and verify.totals.batches:
        split = render_split(per_forward({}, verify.totals.loop_seconds, verify.totals.batches))
        print(f"verify lane, ms a forward by phase since it started: {split}")
    t = report.totals
    print(
        f"requests: {report.active_requests} active, {report.queued_requests} queued, {t.runs} finished; "
        f"acceptance {t.acceptance:.2f}; "
        f"audit events pending: {report.audit_pending}; faults: {len(report.faults)}"
    )
    print(f"health: {health.reason() or 'ok'}")
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    from pipeline.model.prompts import load_messages

    params = _sampling(args)
    speculation_args(args)  # checked here; the pipeline fills in what was left out
    k = None if args.k in (None, "auto") else int(args.k)
    messages = load_messages(args.messages) if args.messages else None
    if messages is not None and args.prompt is not None:
        raise ValueError("give either a PROMPT or --messages, not both")
    config = _config(args)
    if not args.connect:
        require_running(config)
    with _client(args, config) as client:
        client.wait_ready(args.wait)
        submitted = client.submit(
            args.prompt, messages=messages, chat=args.chat, params=params,
            drafter=args.drafter, k=k, max_iterations=args.max_iterations,
        )  # fmt: skip
        try:
            _print_stream(client, submitted.request_id, args.json)
        except KeyboardInterrupt:
            _cancel(client, submitted.request_id)
            return 130
    return 0


# A poll waits this long for news before it returns empty-handed. Ctrl-C is acted on between polls (the
# socket call does not return early), so this bounds how long a stream that is still queued takes to
# notice it; a decoding one returns a chunk every step.
STREAM_POLL_SECONDS = 0.5


def _print_stream(client: Any, request_id: str, as_json: bool) -> None:
    from pipeline.decoding.result import Result

    for item in client.chunks(request_id, wait=STREAM_POLL_SECONDS):
        if isinstance(item, Result):
            if item.error is not None:
                raise ValueError(f"request {item.request_id} failed: {item.error.message}")
            sys.stdout.write(result_json(item) + "\n" if as_json else "\n")
        elif not as_json:
            sys.stdout.write(item.text)
            sys.stdout.flush()


def _cancel(client: Any, request_id: str) -> None:
    """Ctrl-C: the request is cancelled in the pipeline now, which frees its KV cache and its place,
    rather than when the orchestrator stops hearing from this client (timeouts.client_idle)."""
    from pipeline.protocol.client import PipelineError

    client.close()  # the interrupted poll's reply must not be taken for the Cancel's
    sys.stdout.write("\n")
    sys.stdout.flush()
    try:
        client.cancel(request_id)
    except PipelineError as exc:
        print(f"speclanes: request {request_id} was not cancelled: {exc}", file=sys.stderr)
        return
    print(f"speclanes: cancelled request {request_id}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    return BENCHES[args.bench]().main(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.observability.request_ids import AmbiguousId
    from pipeline.observability.trace_files import (
        find_trace,
        read_spans,
        render_tree,
        summary_rows,
        trace_files,
    )

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
    try:
        trace = find_trace(spans, args.request)
    except AmbiguousId as exc:  # a prefix that fits several: they are listed
        raise ValueError(exc.args[0]) from None
    except LookupError as exc:
        raise ValueError(f"{exc.args[0]} in {directory}") from None
    print(msgspec.json.encode(trace).decode() if args.json else render_tree(trace))
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from pipeline.service.certs import make

    directory = Path(args.dir)
    for path in make(directory, args.hosts.split(","), args.days):
        print(path)
    print(f"speclanes: copy {directory}/ca.pem and each host's HOST.pem and HOST.key to that host and")
    print("name them in its [tls] ca_file, cert_file and key_file; ca.key stays here, with nobody else")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from pipeline.model import cache_admin
    from pipeline.model.store import cache_root

    root = cache_root()
    if args.cache == "clear":
        print(f"speclanes: cleared {root} ({cache_admin.clear(root) / 1e6:.1f} MB)")
        return 0
    damaged = 0
    for path, problem in cache_admin.entries(root):
        print(f"{'ok' if problem is None else 'DAMAGED'}  {path}{'' if problem is None else f': {problem}'}")
        damaged += problem is not None
    print(f"speclanes: {damaged} damaged entr{'y' if damaged == 1 else 'ies'} in {root}")
    return 1 if damaged else 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from pipeline.training import cli as training_cli

    return training_cli.main(args)


def cmd_audit(args: argparse.Namespace) -> int:
    from pipeline.audit import cli as audit_cli

    return audit_cli.main(args)


def main(argv: Sequence[str] | None = None) -> int:
    from pipeline.model import BackendUnavailable, ModelFileError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(with_benches="bench" in argv).parse_args(argv)
    from pipeline.protocol.client import PipelineError

    handlers = {
        "generate": cmd_generate,
        "bench": cmd_bench,
        "start": cmd_start,
        "stop": cmd_stop,
        "status": cmd_status,
        "stream": cmd_stream,
        "audit": cmd_audit,
        "certs": cmd_certs,
        "trace": cmd_trace,
        "cache": cmd_cache,
        "drafter": cmd_drafter,
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
