"""What the benchmarks share: the workloads, progress lines, decode rates, and a private
pipeline with the per-process CPU accounting that goes with it.

Each benchmark module declares its own CLI arguments (`add_parser`) and runs from `main(args)`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Runtime as Model
from pipeline.model import backend_key
from pipeline.model.cpu import cpu_name, kernel_flags
from pipeline.protocol.client import Client, PipelineError
from pipeline.protocol.config import Config
from pipeline.protocol.messages import Chunk
from pipeline.service.launch import launch, stop

R = TypeVar("R")  # one run of a benchmark, as `paired` reads its rate


def load_note() -> str:
    """The machine's load when a benchmark starts (1, 5 and 15 minute load averages): figures
    from a busy machine are not comparable with a quiet one's."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
CGROUP = Path("/proc/self/cgroup")


def machine_header(model: Model, curve: Sequence[float] | None = None) -> dict[str, Any]:
    """What a benchmark's figures depend on besides the code, printed before them: the runtime and
    its kernel path, the CPU and the flags its kernels use, the machine's load at the start, and with
    `curve` (`calibration.row_seconds`) what a forward of r rows costs against a forward of one."""
    header: dict[str, Any] = {
        "runtime": backend_key(model), "kernel_path": model.describe(), "cpu": cpu_name(),
        "cpu_flags": kernel_flags(), "load": load_note(),
    }  # fmt: skip
    if curve is not None:
        header["t(rows)/t(1)"] = ",".join(f"{r}:{curve[r - 1] / curve[0]:.2f}" for r in (2, 4, 8, 16, 33))
    return header


def render_header(header: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in header.items())


def scheduler_note(autogroup: Path = AUTOGROUP_ENABLED, cgroup: Path = CGROUP) -> str:
    """How the kernel weighs the pipeline's processes against each other: whether it groups tasks by
    session (`autogroup=1`; that applies to tasks in the root cpu cgroup only) and this process's cpu
    cgroup. With autogroups each lane, a session of its own, is a group weighted like the verify lane's,
    so a busy helper takes two thirds of the core it shares with a forward thread, and the helpers'
    weight moves 8-client figures by up to a tenth (docs/benchmarks.md, "Scheduling the helpers")."""
    try:
        enabled = autogroup.read_text().strip()
    except OSError:
        enabled = "absent"
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        lines = []
    return f"autogroup={enabled} cpu_cgroup={cpu_cgroup(lines)}"


def cpu_cgroup(lines: Sequence[str]) -> str:
    """The cpu controller's cgroup among /proc/<pid>/cgroup's lines ("id:controllers:path"): cgroup v1's
    line naming `cpu`, else the v2 unified line ("0::path")."""
    fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    found = [path for _, controllers, path in fields if "cpu" in controllers.split(",")]
    found += [path for _, controllers, path in fields if controllers == ""]
    return found[0] if found else "unknown"


def progress(bench: str, text: str) -> None:
    """Progress goes to stderr, so `--json` output stays one object."""
    print(f"bench {bench}: {text}", file=sys.stderr, flush=True)


def decode_rate(tokens: int, seconds: float, first_token_seconds: float) -> float:
    """Tokens after the first over the time after the first: decoding speed, prefill excluded."""
    return (tokens - 1) / max(seconds - first_token_seconds, 1e-9)


def result_decode_rate(result: Result) -> float:
    return decode_rate(len(result.tokens), result.stats.wall_seconds, result.stats.prefill_seconds)


def run_decode_rate(run: dict) -> float:
    """Of a peers-bench run: {"tokens", "seconds", "first_token_seconds"}."""
    return decode_rate(len(run["tokens"]), run["seconds"], run["first_token_seconds"])


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


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM as `SystemExit(143)` while inside, so the `finally` blocks that stop what a benchmark
    started still run when it is killed (`timeout`, a CI job's end): by default SIGTERM ends the
    process at once, and the pipeline it launched would go on running. Off the main thread, or
    where a handler is already set, it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def running_pipeline(settings: list[str], env: dict[str, str] | None = None) -> Iterator[Config]:
    """A pipeline in a fresh temp run dir; SIGTERM to its supervisor on the way out, even on error
    or when this process is sent SIGTERM itself (`exit_on_sigterm`). The run dir is removed then,
    unless the pipeline failed to start or an error ended its use: its logs are kept for the reader.

    The environment's SPECLANES_* settings are left out, so a user's configuration cannot make
    the pipeline and the in-process reference differ; `env` adds variables for the pipeline's
    processes (OTEL_* for the tracing bench)."""
    run_dir = Path(tempfile.mkdtemp(prefix="speclanes-bench-"))
    # No HTTP gateway: the bench talks to the orchestrator, and a gateway would take port 8000
    # from a pipeline the user runs (or from the bench's other pipeline).
    overrides = [f"run.dir={run_dir}", "gateway.enabled=false", *settings]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECLANES_")}, **(env or {})}
    ok = False
    with exit_on_sigterm():
        try:
            proc, config = launch(overrides, env=env)
        except BaseException:
            progress("pipeline", f"left the failed pipeline's logs in {run_dir}")
            raise
        try:
            yield config
            ok = True
        except (KeyboardInterrupt, SystemExit):  # stopped (Ctrl-C, `timeout`'s SIGTERM), not failed
            ok = True
            raise
        finally:
            stop(proc)
            if ok:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:
                progress("pipeline", f"left the failed pipeline's logs in {run_dir}")


def settled_status(client: Client, config: Config):
    """Lane totals travel in heartbeats: wait for a few so the last step is counted."""
    time.sleep(3 * config.run.heartbeat_seconds + 0.1)
    return client.status()


def paired(runs: Sequence[R], baseline: Sequence[R], rate: Callable[[R], float]) -> float:
    """The median over the rounds of each round's ratio: a round runs every contender once, back to
    back, so a ratio compares runs seconds apart, not a quiet minute of one against a busy minute
    of the other (on the shared 2-core VMs the same build's plain rate drifts by 10% or more, and
    on the AMD VM a forward's time moved by up to 30% between blocks of seconds in one process)."""
    return statistics.median(rate(a) / rate(b) for a, b in zip(runs, baseline, strict=True))


def lane_pids(report) -> dict[str, int]:
    return {lane.name: lane.pid for lane in report.lanes if lane.pid}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a whole process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each lane, of this process (the clients), and of the machine."""
    snapshot = {name: cpu_seconds(pid) for name, pid in pids.items()}
    times = os.times()
    snapshot["clients"] = times.user + times.system
    snapshot["machine"] = machine_busy_seconds()
    return snapshot


def busy_cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Cores each process kept busy on average, and `others`: everything on the machine that is
    not ours. A busy `others` means the figures were taken on a noisy machine."""
    cores = {name: (after[name] - before[name]) / wall for name in after}
    machine = cores.pop("machine")
    cores["others"] = max(0.0, machine - sum(cores.values()))
    return cores


SAME_ARRIVAL = 0.001  # seconds: chunks closer than this came in one reply


def via_pipeline(client: Client, text: str, params: SamplingParams, drafter: str) -> dict:
    """One chat request through the pipeline, timed from submit to the final object; `gaps` are the
    seconds between successive arrivals of tokens (the stalls a reader sees). The chunks of one poll's
    reply come within microseconds of each other: those within `SAME_ARRIVAL` count as one arrival."""
    start = time.perf_counter()
    request_id = client.submit(text, chat=True, params=params, drafter=drafter).request_id
    arrivals: list[float] = []
    done = None
    for done in client.chunks(request_id):
        now = time.perf_counter()
        if isinstance(done, Chunk) and done.tokens and (not arrivals or now - arrivals[-1] > SAME_ARRIVAL):
            arrivals.append(now)
    seconds = time.perf_counter() - start
    assert isinstance(done, Result)
    if done.error is not None:
        raise PipelineError(done.error.kind, f"request {request_id}: {done.error.message}")
    stats = done.stats
    return {
        "prompt_tokens": done.prompt_tokens, "tokens": done.tokens, "text": done.text,
        "seconds": seconds, "tokens_per_second": len(done.tokens) / seconds,
        "orchestrator_tokens_per_second": stats.tokens_per_second, "steps": stats.steps,
        "acceptance_rate": stats.acceptance_rate, "gaps": [b - a for a, b in itertools.pairwise(arrivals)],
    }  # fmt: skip


def same_output(a: dict, b: dict) -> bool:
    return a["prompt_tokens"] == b["prompt_tokens"] and a["tokens"] == b["tokens"] and a["text"] == b["text"]


def chat_prompt(model: Model, text: str) -> list[int]:
    assert model.tokenizer is not None
    return model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": text}]))


# A base model (no chat template, as Gemma 3 270M) continues text rather than answering it: the same
# three tasks as completions, so the drafters meet the same kinds of text (prose, a copy, a code edit).
COMPLETION_WORKLOADS = {
    "chat": "Once upon a time, there was a robot who wanted to learn to paint. Every morning, the robot",
    "quote": f"{PASSAGE}\n\nThe same passage again, word for word:\n\n",
    "code": f"```python\n{CODE}```\n\nThe function with `total` renamed to `running_sum`:\n\n```python\n",
}


def workload_prompt(model: Model, workload: str, text: str) -> list[int]:
    """A workload's prompt: a user's chat turn for a model with a chat template, else the workload's
    completion form (`COMPLETION_WORKLOADS`; `text` itself for a workload without one)."""
    assert model.tokenizer is not None
    if model.tokenizer.chat_template:
        return chat_prompt(model, text)
    return model.tokenizer.encode(COMPLETION_WORKLOADS.get(workload, text))
