"""speclanes against the tools a user would otherwise pick, on the same file, prompts and cores.

Rows: speclanes in this process and through a private pipeline with the drafters `none`,
`ngram` and `auto`; HF transformers (torch CPU, float32 weights dequantized from the same GGUF
with `gguf_file=`) plain and with `prompt_lookup_num_tokens`; llama-cpp-python plain and with
`LlamaPromptLookupDecoding`. HTTP against HTTP (`http_peers`): speclanes' gateway on the same
pipeline (`--http-drafters`) and llama-server, single stream and N clients at once. Every row gets
the same prompt token ids (speclanes' tokenizer and chat template), greedy decoding, the same
number of threads and exactly `--max-tokens` new tokens: EOS is ignored everywhere (the argmax is
taken even when it is EOS), so all rows do the same work.

The peers run in worker processes (`peer_workers.py`), one at a time, never two rows at once; runs
are interleaved (each repeat visits every row, in a rotated order) and figures are medians, so
drift on a shared machine hits every row alike. A peer that is not installed (see
`ops/bench/install_peers.sh`) or fails to start is skipped and the output says why; one that
crashes during the run loses its rows, and the output says it crashed.

The reference is speclanes `none` in this process. Peers with other numerics (llama.cpp's
quantized kernels) may legitimately differ from it, so each row also says whether its output
equals its own system's plain mode: that is the exactness check for a peer's speculation.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pipeline.bench import http_clients, http_peers, llama_server
from pipeline.bench.common import (
    WORKLOADS,
    chat_prompt,
    cpu_seconds,
    exit_on_sigterm,
    lane_pids,
    machine_busy_seconds,
    run_decode_rate,
    running_pipeline,
)
from pipeline.bench.common import progress as common_progress
from pipeline.bench.flags import add_common_flags, add_set_flag
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Runtime as Model
from pipeline.model import backend_key, load_model, set_backend
from pipeline.model.cpu import cpu_name, kernel_flags
from pipeline.model.default import model_path
from pipeline.model.draft_head import DraftHead, head_for
from pipeline.protocol.client import Client

GOAL_WORKLOADS = ("quote", "code")
PEERS = {"hf": ("torch", "transformers"), "llama_cpp": ("llama_cpp",), "llama_server": ()}
PEER_NAMES = {"hf": "transformers", "llama_cpp": "llama.cpp", "llama_server": http_peers.LLAMA_SERVER}
SERVER_PEERS = ("llama_server",)  # peers reached over HTTP; the others load in a worker process


@dataclass(frozen=True)
class Variant:
    """One row of the table: a system and its mode; `plain` names the row it is compared with."""

    system: str  # speclanes | pipeline | transformers | llama.cpp | gateway | llama-server
    mode: str  # a drafter for speclanes, plain | lookup for the peers
    plain: str  # the mode of the same system without speculation

    @property
    def name(self) -> str:
        return f"{self.system} {self.mode}"

    @property
    def speculative(self) -> bool:
        return self.mode != self.plain

    @property
    def http(self) -> bool:
        return self.system in http_peers.HTTP_SYSTEMS


class PeerCrashed(RuntimeError):
    """A peer's process died during the run: its rows are dropped and the output says why."""


REFERENCE = Variant("speclanes", "none", "none")


progress = functools.partial(common_progress, "peers")


# --- which rows run -------------------------------------------------------------------


def peer_missing(peer: str) -> str | None:
    """Why a peer cannot run here (a module that does not import, a binary not built), or None."""
    if peer == "llama_server":
        return llama_server.missing()
    missing = [m for m in PEERS[peer] if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed ({', '.join(missing)}; run ops/bench/install_peers.sh)"
    return None


def variants(
    drafters: list[str], pipeline: bool, peers: list[str], http_drafters: tuple[str, ...] = ()
) -> list[Variant]:
    """The rows in table order: the reference first; the gateway's rows come with the pipeline's."""
    rows = [Variant("speclanes", d, "none") for d in drafters]
    if pipeline:
        rows += [Variant("pipeline", d, "none") for d in drafters]
        rows += [Variant(http_peers.GATEWAY, d, "none") for d in http_drafters]
    for peer in peers:
        if peer == "llama_server":
            rows.append(Variant(http_peers.LLAMA_SERVER, "plain", "plain"))
        else:
            rows += [Variant(PEER_NAMES[peer], m, "plain") for m in ("plain", "lookup")]
    return rows


def rotated(items: list, shift: int) -> list:
    """`items` starting at `shift`: each repeat runs the rows in another order."""
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


# --- the peers' worker processes ------------------------------------------------------


class PeerWorker:
    """A peer model loaded in its own process; `run` sends one request and waits for the reply."""

    def __init__(self, peer: str, model_path: Path, threads: int, lookup: int) -> None:
        command = [sys.executable, "-m", "pipeline.bench.peer_workers", peer, str(model_path),
                   str(threads), str(lookup)]  # fmt: skip
        self.peer = peer
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        hello = self._reply()
        self.info = hello.get("info", {})

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            why = llama_server.exit_reason(code)
            raise PeerCrashed(f"{PEER_NAMES[self.peer]} worker {why} (its stderr is above)")
        return json.loads(line)

    def run(self, mode: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        request = {"mode": "prompt_lookup" if mode == "lookup" else "plain", "prompt": prompt,
                   "max_tokens": max_tokens}  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"{PEER_NAMES[self.peer]} {mode}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_workers(
    peers: list[str], model_path: Path, threads: int, lookup: int, skipped: dict[str, str]
) -> dict[str, PeerWorker]:
    """Workers for the peers that are installed and start; the others go into `skipped`."""
    workers: dict[str, PeerWorker] = {}
    for peer in (p for p in peers if p not in SERVER_PEERS):
        reason = peer_missing(peer)
        if reason is None:
            progress(f"loading {PEER_NAMES[peer]} in a worker process")
            try:
                workers[peer] = PeerWorker(peer, model_path, threads, lookup)
            except (RuntimeError, OSError, json.JSONDecodeError) as exc:
                reason = f"failed to start: {exc}"
        if reason is not None:
            skipped[PEER_NAMES[peer]] = reason
            progress(f"skipping {PEER_NAMES[peer]}: {reason}")
    return workers


def start_server(
    peers: list[str], model_path: Path, threads: int, clients: int, slot_tokens: int, skipped: dict[str, str]
) -> llama_server.LlamaServer | None:
    """llama-server with a slot per client, if asked for and it starts; else None and `skipped` says why."""
    if "llama_server" not in peers:
        return None
    reason = llama_server.missing()
    if reason is None:
        progress(f"starting llama-server (-t {threads} --parallel {max(clients, 1)})")
        try:
            return llama_server.LlamaServer(model_path, threads, max(clients, 1), slot_tokens)
        except (http_clients.StreamError, OSError) as exc:
            reason = f"failed to start: {exc}"
    skipped[http_peers.LLAMA_SERVER] = reason
    progress(f"skipping llama-server: {reason}")
    return None


# --- one run of one row ---------------------------------------------------------------


def run_in_process(model: Model, prompt: list[int], max_tokens: int, source, drafter: str) -> dict[str, Any]:
    """speclanes in this process; the first token comes out of the prefill."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    completion = decode(model, prompt, params, source, k=0 if drafter == "none" else None)
    stats = completion.stats
    return {"tokens": list(completion.tokens), "text": completion.text, "seconds": stats.wall_seconds,
            "first_token_seconds": stats.prefill_seconds, "steps": stats.steps}  # fmt: skip


def run_pipeline(
    client: Client, text: str, prompt: list[int], max_tokens: int, drafter: str
) -> dict[str, Any]:
    """One chat request through the pipeline, timed as a client sees it (submit to final object);
    checks that the pipeline tokenized the prompt to the same ids as everyone else got."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start, first, done = time.perf_counter(), None, None
    request_id = client.submit(text, chat=True, params=params, drafter=drafter).request_id
    for item in client.chunks(request_id):
        if isinstance(item, Result):
            done = item
        elif first is None and item.tokens:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    if done is None or done.error is not None:
        raise RuntimeError(f"pipeline {drafter}: {done and done.error}")
    if list(done.prompt_tokens) != prompt:
        raise RuntimeError("the pipeline tokenized the prompt differently")
    return {"tokens": list(done.tokens), "seconds": seconds,
            "first_token_seconds": first or seconds, "steps": done.stats.steps}  # fmt: skip


class Runner:
    """Runs any row; holds the in-process model, the peers, the repeat's pipeline client, gateway
    address and draft sources, and the peers that died during the run (`dead`: system -> why)."""

    def __init__(
        self,
        model: Model,
        workers: dict[str, PeerWorker],
        server: llama_server.LlamaServer | None,
        max_tokens: int,
        head: DraftHead | None = None,
    ) -> None:
        """`head`: the draft head the in-process rows draft with, the one the pipeline finds."""
        self.model, self.workers, self.server, self.max_tokens = model, workers, server, max_tokens
        self.head = head
        self.client: Client | None = None
        self.gateway: str | None = None
        self.http = http_clients.new_client()
        self.sources: dict[str, Any] = {}
        self.dead: dict[str, str] = {}

    def new_repeat(self, drafters: list[str], client: Client | None, gateway: str | None = None) -> None:
        """Fresh in-process draft sources, like the fresh pipeline: `auto`'s cross-request cache
        starts empty each repeat on both sides and is fed the same requests in the same order."""
        self.sources = {d: make_draft_source(d, self.model, None, self.head) for d in drafters}
        self.client, self.gateway = client, gateway

    def run(self, variant: Variant, workload: str, prompt: list[int], max_tokens: int | None = None) -> dict:
        n = max_tokens or self.max_tokens
        if variant.system == "speclanes":
            return run_in_process(self.model, prompt, n, self.sources[variant.mode], variant.mode)
        if variant.system == "pipeline":
            assert self.client is not None
            return run_pipeline(self.client, WORKLOADS[workload], prompt, n, variant.mode)
        if variant.http:
            url = self.gateway if variant.system == http_peers.GATEWAY else self.server_url()
            request = http_peers.body(variant.system, variant.mode, prompt, n)
            with self.server_watch(variant):
                return http_clients.stream(self.http, f"{url}/v1/completions", request)
        peer = next(p for p, name in PEER_NAMES.items() if name == variant.system)
        return self.workers[peer].run(variant.mode, prompt, n)

    def server_url(self) -> str:
        assert self.server is not None
        return self.server.url

    @contextlib.contextmanager
    def server_watch(self, variant: Variant) -> Iterator[None]:
        """A failed request to llama-server becomes PeerCrashed where the server has died."""
        try:
            yield
        except (httpx.HTTPError, http_clients.StreamError) as exc:
            why = (
                self.server.crashed(wait=2.0)
                if self.server and variant.system == http_peers.LLAMA_SERVER
                else None
            )
            if why:
                raise PeerCrashed(f"llama-server {why}") from exc
            raise

    def attempt(self, variant: Variant, workload: str, prompt: list[int], max_tokens: int | None = None):
        """`run`, or None where the row's peer is dead or dies now (then noted in `dead`)."""
        if variant.system in self.dead:
            return None
        try:
            return self.run(variant, workload, prompt, max_tokens)
        except PeerCrashed as exc:
            self.dead[variant.system] = str(exc)
            progress(f"{variant.system} crashed, its rows are dropped: {exc}")
            return None

    def clients_phase(
        self, variant: Variant, prompts: dict[str, list[int]], clients: int, settings: list[str]
    ) -> tuple[dict | None, float]:
        """An HTTP row's N-clients phase (None where its peer is dead or dies now), and the CPU
        seconds of the pipeline started for it."""
        if variant.system in self.dead:
            return None, 0.0
        if variant.system == http_peers.GATEWAY:
            return http_peers.gateway_phase(settings, variant.mode, prompts, clients, self.max_tokens)
        try:
            with self.server_watch(variant):
                phase = http_peers.drive(self.server_url(), variant.system, variant.mode, prompts, clients,
                                         self.max_tokens)  # fmt: skip
                return phase, 0.0
        except PeerCrashed as exc:
            self.dead[variant.system] = str(exc)
            progress(f"{variant.system} crashed, its rows are dropped: {exc}")
            return None, 0.0


# --- the run --------------------------------------------------------------------------


def process_cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def one_repeat(
    runner: Runner, rows: list[Variant], prompts: dict[str, list[int]], repeat: int, runs: dict
) -> None:
    """Every workload through every row once, in an order rotated by the repeat."""
    for workload, prompt in prompts.items():
        progress(f"repeat {repeat + 1}: {workload}")
        for variant in rotated(rows, repeat):
            time.sleep(0.2)  # let the previous row's spinning thread pools go idle
            if (result := runner.attempt(variant, workload, prompt)) is not None:
                runs[workload][variant.name].append(result)


def piped_repeat(
    runner: Runner, rows: list[Variant], prompts: dict[str, list[int]], repeat: int, runs: dict,
    settings: list[str], drafters: list[str],
) -> float:  # fmt: skip
    """One repeat on a fresh pipeline, its gateway on where gateway rows are in; returns the CPU
    seconds its processes used."""
    port = http_clients.free_port()
    gateway = f"http://127.0.0.1:{port}" if any(v.system == http_peers.GATEWAY for v in rows) else None
    extra = http_peers.gateway_settings(port) if gateway else []
    with (
        running_pipeline([*settings, *extra]) as config,
        Client(config.addresses.client, timeout=60.0) as client,
    ):
        if gateway:
            http_clients.wait_healthy(gateway, 60.0)
        pids = list(lane_pids(client.status()).values())
        lanes0 = process_cpu(pids)
        runner.new_repeat(drafters, client, gateway)
        if repeat == 0:
            warm_up(runner, rows, prompts)
        one_repeat(runner, rows, prompts, repeat, runs)
        return process_cpu(pids) - lanes0


def clients_round(
    runner: Runner, rows: list[Variant], prompts: dict[str, list[int]], repeat: int, phases: dict,
    clients: int, settings: list[str],
) -> float:  # fmt: skip
    """Every HTTP row's N-clients phase once, in an order rotated by the repeat; returns the CPU
    seconds of the pipelines started for them."""
    cpu = 0.0
    for variant in rotated([v for v in rows if v.http], repeat):
        progress(f"repeat {repeat + 1}: {clients} clients, {variant.name}")
        phase, used = runner.clients_phase(variant, prompts, clients, settings)
        if phase is not None:
            phases[variant.name].append(phase)
        cpu += used
    return cpu


def measure(
    args: argparse.Namespace, model: Model, rows: list[Variant], runner: Runner
) -> tuple[dict, dict, dict]:
    """All repeats; a fresh pipeline per repeat if pipeline or gateway rows are in, then the HTTP
    rows' clients phases. Returns the single-stream runs, the clients phases and load figures."""
    prompts = {w: chat_prompt(model, text) for w, text in WORKLOADS.items()}
    runs: dict = {w: {v.name: [] for v in rows} for w in prompts}
    phases: dict = {v.name: [] for v in rows if v.http}
    drafters = sorted({v.mode for v in rows if v.system in ("speclanes", "pipeline", http_peers.GATEWAY)})
    settings = [*([f"model.path={args.model}"] if args.model else []), *args.set]
    server = [runner.server.proc.pid] if runner.server else []
    ours = [os.getpid(), *(w.proc.pid for w in runner.workers.values()), *server]
    started, busy0, load0 = time.perf_counter(), machine_busy_seconds(), os.getloadavg()
    own_cpu, own0 = 0.0, process_cpu(ours)
    for repeat in range(args.repeats):
        progress(f"repeat {repeat + 1}/{args.repeats}, load average {os.getloadavg()[0]:.2f}")
        if any(v.system in ("pipeline", http_peers.GATEWAY) for v in rows):
            own_cpu += piped_repeat(runner, rows, prompts, repeat, runs, settings, drafters)
        else:
            runner.new_repeat(drafters, None)
            if repeat == 0:
                warm_up(runner, rows, prompts)
            one_repeat(runner, rows, prompts, repeat, runs)
        if args.clients:
            own_cpu += clients_round(runner, rows, prompts, repeat, phases, args.clients, settings)
    wall = time.perf_counter() - started
    own_cpu += process_cpu(ours) - own0
    machine = (machine_busy_seconds() - busy0) / wall
    load = {"loadavg_start": load0, "loadavg_end": os.getloadavg(), "wall_seconds": wall,
            "cores_busy_ours": own_cpu / wall, "cores_busy_others": max(0.0, machine - own_cpu / wall),
            "cores": os.cpu_count()}  # fmt: skip
    return runs, phases, load


def warm_up(runner: Runner, rows: list[Variant], prompts: dict[str, list[int]]) -> None:
    """One short untimed run per row: first calls pay for lazy initialisation (torch especially).
    Runs before the repeat's draft sources are used for real, then they are replaced."""
    progress("warming up every row")
    workload, prompt = next(iter(prompts.items()))
    for variant in rows:
        runner.attempt(variant, workload, prompt, max_tokens=8)
    runner.new_repeat(list(runner.sources), runner.client, runner.gateway)


# --- summary --------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def equality(runs: list[dict], want: list[int]) -> dict[str, Any]:
    """Whether every run's tokens equal `want`, and the earliest difference if not."""
    diffs = [d for r in runs if (d := first_difference(r["tokens"], want)) is not None]
    return {"equal": not diffs, "first_difference": min(diffs) if diffs else None}


def summarise(runs: dict, rows: list[Variant]) -> dict:
    """Per workload and row: medians of tokens/s (end to end and after the first token), speed-ups,
    mean accepted length (new tokens after the first per target forward after the prompt's) and
    the equality checks."""
    out: dict = {}
    for workload, by_row in runs.items():
        rates = {
            name: statistics.median(len(r["tokens"]) / r["seconds"] for r in rs)
            for name, rs in by_row.items()
        }
        reference = by_row[REFERENCE.name][0]["tokens"]
        out[workload] = {}
        for v in rows:
            rs = by_row[v.name]
            plain = f"{v.system} {v.plain}"
            out[workload][v.name] = {
                "system": v.system, "mode": v.mode, "tokens": len(rs[-1]["tokens"]),
                "tokens_per_second": rates[v.name],
                "decode_tokens_per_second": statistics.median(run_decode_rate(r) for r in rs),
                "first_token_seconds": statistics.median(r["first_token_seconds"] for r in rs),
                "speedup_vs_plain": rates[v.name] / rates[plain],
                "speedup_vs_reference": rates[v.name] / rates[REFERENCE.name],
                "mean_accepted_length": statistics.median(accepted_length(r) for r in rs),
                "step_ms": statistics.median(step_ms(r) for r in rs),
                "tokens_per_second_runs": [len(r["tokens"]) / r["seconds"] for r in rs],
                "reference": equality(rs, reference),
                "own_plain": equality(rs, by_row[plain][0]["tokens"]) if v.speculative else None,
            }  # fmt: skip
    return out


def step_ms(run: dict) -> float:
    """Mean wall time per target forward after the first token (draft, verify and overheads)."""
    return 1000 * (run["seconds"] - run["first_token_seconds"]) / run["steps"] if run["steps"] > 0 else 0.0


def accepted_length(run: dict) -> float:
    return (len(run["tokens"]) - 1) / run["steps"] if run["steps"] > 0 else 0.0


def goal(summary: dict) -> list[dict]:
    """speclanes auto (each path) against each peer's prompt-lookup mode on quote and code."""
    checks = []
    for workload in GOAL_WORKLOADS:
        rows = summary.get(workload, {})
        for ours in ("speclanes auto", "pipeline auto"):
            for peer in ("transformers lookup", "llama.cpp lookup"):
                if ours in rows and peer in rows:
                    ratio = rows[ours]["tokens_per_second"] / rows[peer]["tokens_per_second"]
                    checks.append({"workload": workload, "ours": ours, "peer": peer, "ratio": ratio})
    return checks


# --- report ---------------------------------------------------------------------------


def same_text(check: dict | None) -> str:
    if check is None:
        return "-"
    return "yes" if check["equal"] else f"no (from token {check['first_difference']})"


def render_table(summary: dict) -> list[str]:
    lines = [
        "| workload | system | mode | tok/s | speed-up vs own plain | vs speclanes none | decode tok/s "
        "| first token s | mean accepted len | ms/step | = reference | = own plain |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for workload, by_row in summary.items():
        for r in by_row.values():
            lines.append(
                f"| {workload} | {r['system']} | {r['mode']} | {r['tokens_per_second']:.1f} "
                f"| {r['speedup_vs_plain']:.2f}x | {r['speedup_vs_reference']:.2f}x "
                f"| {r['decode_tokens_per_second']:.1f} | {r['first_token_seconds']:.2f} "
                f"| {r['mean_accepted_length']:.2f} | {r['step_ms']:.1f} | {same_text(r['reference'])} "
                f"| {same_text(r['own_plain'])} |"
            )
    return lines


def render_goal(checks: list[dict]) -> list[str]:
    if not checks:
        return ["Goal: not checked (needs speclanes auto and at least one peer's prompt-lookup row)."]
    lines = [f"Goal: speclanes `auto` faster end to end than each peer's prompt lookup on "
             f"{' and '.join(GOAL_WORKLOADS)}:"]  # fmt: skip
    for c in checks:
        verdict = "faster" if c["ratio"] > 1 else "SLOWER"
        lines.append(f"- {c['workload']}: {c['ours']} / {c['peer']} = {c['ratio']:.2f}x ({verdict})")
    met = all(c["ratio"] > 1 for c in checks)
    lines.append(f"Goal {'met' if met else 'NOT met'}.")
    return lines


def render(results: dict, chart: str | None) -> str:
    m, load = results["meta"], results["load"]
    lines = [
        f"Peer benchmark, {m['date']}: {m['model']}, {m['max_tokens']} new tokens (EOS ignored), greedy, "
        f"{m['threads']} threads, {m['repeats']} interleaved repeats (medians), on {m['cpu']}.",
        f"speclanes runtime {m['runtime']}: {m['kernel_path']}; CPU flags {', '.join(m['cpu_flags'])}.",
        "",
        *render_table(results["summary"]),
        "",
        "tok/s: new tokens over wall time from request to last token (prefill included; the pipeline "
        "as a client sees it). decode tok/s: tokens after the first over the time after the first. "
        "mean accepted len: tokens after the first per target forward after the prompt's; "
        "ms/step: time after the first token per such forward (drafting and overheads included). "
        '= reference: output equals speclanes `none` in-process ("from token i": first difference); '
        "= own plain: a speculative row equals its own system's plain output.",
        "",
        *render_goal(results["goal"]),
        "",
        *http_peers.render(results["http"], m["clients"]),
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}. Prompt lookup: "
        f"{m['lookup_tokens']} tokens per draft in both peers (their default n-gram sizes).",
        f"Machine load: loadavg {fmt_load(load['loadavg_start'])} at start, {fmt_load(load['loadavg_end'])} "
        f"at end; over the {load['wall_seconds']:.0f} s run this benchmark kept "
        f"{load['cores_busy_ours']:.2f} cores busy and other processes "
        f"{load['cores_busy_others']:.2f} (of {load['cores']}).",
    ]
    for name, reason in results["skipped"].items():
        lines.append(f"Skipped {name}: {reason}.")
    if chart:
        lines += ["", f"![tokens/s by workload]({chart})"]
    return "\n".join(lines) + "\n"


def fmt_load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values)


COLOUR_FAMILY = {"speclanes": 0, "transformers": 4, "llama.cpp": 8, "pipeline": 12}  # tab20c hues


def bar_colour(system: str, mode: str) -> int:
    """One hue per system (tab20c has four shades per hue); the darker the shade, the more speculation."""
    shade = {"none": 2, "plain": 2, "ngram": 1}.get(mode, 0)
    return COLOUR_FAMILY.get(system, 16) + shade


def plot(summary: dict, path: Path, title: str) -> bool:
    """Grouped bars of end-to-end tokens/s per workload; False if matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary)
    names = list(summary[workloads[0]])
    width = 0.84 / len(names)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.42 * len(names) * len(workloads)), 5.5))
    cmap = plt.get_cmap("tab20c")
    for i, name in enumerate(names):
        row = summary[workloads[0]][name]
        xs = [w + (i - (len(names) - 1) / 2) * width for w in range(len(workloads))]
        ys = [summary[w][name]["tokens_per_second"] for w in workloads]
        bars = ax.bar(xs, ys, width, label=name, color=cmap(bar_colour(row["system"], row["mode"])))
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("new tokens / s (end to end, median)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- main -----------------------------------------------------------------------------


def peer_names(text: str) -> list[str]:
    """--peers: a misspelt peer is refused at the command line, not found missing halfway."""
    names = [p for p in text.split(",") if p]
    if unknown := [p for p in names if p not in PEERS]:
        choices = ", ".join(PEERS)
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)} (choose from {choices})")
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench peers` and its flags."""
    parser = sub.add_parser(
        "peers",
        help="speclanes vs transformers, llama-cpp-python and llama-server (ops/bench/install_peers.sh)",
    )
    add_common_flags(parser, repeats=3)
    parser.add_argument(
        "--peers", type=peer_names, default="hf,llama_cpp,llama_server",
        help=f"peers to run, of {','.join(PEERS)} (skipped if missing)",
    )  # fmt: skip
    parser.add_argument("--drafters", default="none,ngram,auto", help="speclanes drafters")
    parser.add_argument(
        "--http-drafters", default="none,auto", help="drafters of the gateway's rows ('': none)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=8,
        help="concurrent HTTP clients, and llama-server's slots (0: no such phase)",
    )
    parser.add_argument(
        "--no-pipeline", action="store_true", help="speclanes in-process rows only (no gateway)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens (EOS ignored)")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="peers' prompt-lookup drafts")
    parser.add_argument(
        "--output", default="ops/bench/peers.md", help="table file; the chart goes next to it ('-': none)"
    )
    add_set_flag(parser)


def slot_tokens(model: Model, max_tokens: int) -> int:
    """A llama-server slot's context: the longest workload prompt, the answer and some room, in 256s."""
    longest = max(len(chat_prompt(model, text)) for text in WORKLOADS.values())
    return -(-(longest + max_tokens + 64) // 256) * 256


def main(args: argparse.Namespace) -> int:
    with exit_on_sigterm():  # so `finally` stops pipelines and servers when the bench is killed
        return peers_run(args)


def peers_run(args: argparse.Namespace) -> int:
    served = model_path(args.model)
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or 2)
    drafters = ["none", *(d for d in args.drafters.split(",") if d != "none")]
    http_drafters = tuple(d for d in args.http_drafters.split(",") if d)
    skipped: dict[str, str] = {}
    peers = args.peers
    model = load_model(served, set_backend(args.set))
    workers = start_workers(peers, served, threads, args.lookup_tokens, skipped)
    server = start_server(peers, served, threads, args.clients, slot_tokens(model, args.max_tokens), skipped)
    found = [p for p in peers if p in workers or (p == "llama_server" and server)]
    rows = variants(drafters, not args.no_pipeline, found, http_drafters)
    runner = Runner(model, workers, server, args.max_tokens, head_for(served, model.cfg, model.embed))
    try:
        runs, phases, load = measure(args, model, rows, runner)
    finally:
        runner.http.close()
        for worker in workers.values():
            worker.close()
        if server:
            server.close()
    for system, why in runner.dead.items():
        skipped[system] = f"crashed during the run: {why}"
    results = results_of(args, model, rows, runner, runs, phases) | {"load": load, "skipped": skipped}
    results["meta"] |= {"date": datetime.date.today().isoformat(), "model": served.name, "threads": threads}
    write_outputs(args, results)
    speclanes_equal = all(
        r["reference"]["equal"] for r in summary_rows(results["summary"], "speclanes", "pipeline")
    )
    return 0 if speclanes_equal and http_peers.gateway_equal(results["http"]) else 1


def results_of(
    args: argparse.Namespace, model: Model, rows: list[Variant], runner: Runner, runs: dict, phases: dict
) -> dict:
    """The summaries of the rows whose peer lived through the run, the goals and the run's settings."""
    import numpy

    versions = {"numpy": numpy.__version__}
    for worker in runner.workers.values():
        versions.update({k: str(v) for k, v in worker.info.items() if k != "threads"})
    if runner.server:
        versions["llama-server"] = (
            f"llama-cpp-python {llama_server.VENDORED} vendored ({llama_server.binary()})"
        )
    alive = [v for v in rows if v.system not in runner.dead]
    direct, http = [v for v in alive if not v.http], [v for v in alive if v.http]
    summary = summarise({w: {v.name: by[v.name] for v in direct} for w, by in runs.items()}, direct)
    references = {w: by[REFERENCE.name][0]["text"] for w, by in runs.items()}
    eos_chars = {w: eos_char(model, by[REFERENCE.name][0]["tokens"]) for w, by in runs.items()}
    single = {w: {v.name: by[v.name] for v in http} for w, by in runs.items()}
    http_summary = http_peers.summarise(
        single, {v.name: phases[v.name] for v in http}, references, args.max_tokens, eos_chars
    )
    return {
        "meta": {"cpu": f"{cpu_name()}, {os.cpu_count()} cores", "cpu_flags": kernel_flags(),
                 "runtime": backend_key(model), "kernel_path": model.describe(),
                 "max_tokens": args.max_tokens, "repeats": args.repeats, "clients": args.clients,
                 "lookup_tokens": args.lookup_tokens, "versions": versions},
        "summary": summary, "goal": goal(summary), "http": http_summary,
        "http_speedups": http_peers.speedups(http_summary),
    }  # fmt: skip


def eos_char(model: Model, tokens: list[int]) -> int | None:
    """The length of the text before the first end-of-sequence token (None where there is none)."""
    assert model.tokenizer is not None
    eos = model.tokenizer.eos_id
    return len(model.tokenizer.decode(tokens[: tokens.index(eos)])) if eos in tokens else None


def summary_rows(summary: dict, *systems: str) -> list[dict]:
    return [r for by_row in summary.values() for r in by_row.values() if r["system"] in systems]


def write_outputs(args: argparse.Namespace, results: dict) -> None:
    """The table to stdout (or JSON), and, unless --output is '-', to OUTPUT with the chart next to it."""
    chart = None
    if args.output != "-":
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        png = out.with_suffix(".png")
        m = results["meta"]
        title = f"{m['model']}, {m['max_tokens']} new tokens, greedy, {m['threads']} threads"
        if plot(results["summary"], png, title):
            chart = png.name
        else:
            results["skipped"]["chart"] = "matplotlib is not installed"
        out.write_text(render(results, chart))
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
        progress(f"wrote {out}, {out.with_suffix('.json')}" + (f" and {png}" if chart else ""))
    print(json.dumps(results, indent=2) if args.json else render(results, chart), end="")
