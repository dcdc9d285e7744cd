"""Start a pipeline in the background and wait until every lane it runs is up.

One helper for `speclanes start --detach`, the benchmarks and the tests: the supervisor runs as
`python -m pipeline.cli start` with the same configuration file, `--set` overrides and
environment the caller's `Config` was read with, its output in the run directory's
supervisor.log, and it is stopped (SIGTERM, then SIGKILL) if it never becomes ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.protocol.client import Client, PipelineError
from pipeline.protocol.config import Config, load_config
from pipeline.service.run_dir import RunDirError, running_supervisor, secure

LOG_TAIL_BYTES = 65536


def launch(
    settings: Sequence[str] = (),
    *,
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[subprocess.Popen[bytes], Config]:
    """The running supervisor and the configuration its processes use."""
    env = dict(os.environ if env is None else env)
    config = load_config(config_path, settings, environ=env)
    run_dir = secure(Path(config.run.dir))
    if (holder := running_supervisor(run_dir)) is not None:
        raise RunDirError(f"a pipeline is already running in {run_dir} (supervisor pid {holder or '?'})")
    command = [sys.executable, "-m", "pipeline.cli", "start"]
    command += ["--config", os.path.abspath(config_path)] if config_path else []
    command += [f"--set={item}" for item in settings]
    log_path = run_dir / "supervisor.log"
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
        )
    finally:
        os.close(log)
    try:
        wait_ready(proc, config, log_path, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, config


def wait_ready(proc: subprocess.Popen[bytes], config: Config, log_path: Path, timeout: float) -> None:
    """Until every lane is up; at once if the supervisor exits first (its last error line says why)."""

    def ours() -> bool:
        if proc.poll() is not None:
            why = f"the supervisor exited ({proc.returncode}): {last_error(log_path)}"
            raise PipelineError("unavailable", why)
        return running_supervisor(Path(config.run.dir)) == proc.pid  # until it holds the lock: not ours

    with Client(config.addresses.client, timeout=1.0, tls=config.tls) as client:
        client.wait_ready(timeout, ours=ours)


def last_error(log_path: Path, since: int = 0) -> str:
    """The log's last line that says what went wrong (an error, else simply the last line), in what
    was written from byte `since` on: one process's own output in a log its predecessors share.
    Only the last 64 KiB are read: a log that has grown for days costs no more."""
    try:
        with log_path.open("rb") as log:
            log.seek(max(since, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(empty log)"])[-1].strip().lstrip("| ")  # "| ": an exception group's frame


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """Stop a pipeline the benchmarks or the tests started, at once: SIGINT, so the supervisor
    stops its children in order without draining what is in flight (SIGTERM would wait up to
    shutdown.drain_seconds); SIGKILL only if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
