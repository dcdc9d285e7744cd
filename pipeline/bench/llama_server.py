"""llama-server, the HTTP peer of `speclanes bench peers`: where its build is, starting it on the
benchmark's model and cores, and telling a server that is missing from one that crashed.

`ops/bench/install_peers.sh` builds it into `.venv/peers/llama.cpp/build/bin` from the llama.cpp that
llama-cpp-python 0.3.36 vendors, without the AMX kernels that crash on AMX machines; the shared
libraries it needs sit beside it. `SPECLANES_LLAMA_SERVER` names another binary. It runs as users
run it for several clients: `-t THREADS --parallel N`, each slot with room for the longest prompt
and answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from pipeline.bench.http_clients import StreamError, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
VENDORED = "0.3.36"  # the llama-cpp-python whose llama.cpp install_peers.sh builds
BUILT = ROOT / ".venv" / "peers" / "llama.cpp" / "build" / "bin" / "llama-server"


def binary() -> Path:
    return Path(os.environ.get("SPECLANES_LLAMA_SERVER") or BUILT)


def missing() -> str | None:
    """Why llama-server cannot run here, or None."""
    path = binary()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"not installed ({path} is missing; run ops/bench/install_peers.sh)"
    return None


def exit_reason(code: int) -> str:
    """A dead process's return code in words: a signal by its name."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class LlamaServer:
    """A llama-server on a free loopback port, its log in a temporary file (its last lines are
    quoted when it dies)."""

    def __init__(self, model: Path, threads: int, parallel: int, slot_tokens: int, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, name = tempfile.mkstemp(prefix="speclanes-llama-server-", suffix=".log")
        self.log = Path(name)
        bin_dir = binary().parent
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(bin_dir),
               os.environ.get("LD_LIBRARY_PATH")]))}  # fmt: skip
        command = [str(binary()), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                   "--parallel", str(parallel), "-c", str(parallel * slot_tokens),
                   "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env)
        os.close(fd)
        try:
            wait_healthy(self.url, timeout, alive=lambda: self.proc.poll() is None)
        except StreamError:
            reason = self.crashed() or f"did not become ready within {timeout:.0f} s"
            self.close()
            raise StreamError(f"llama-server {reason}") from None

    def crashed(self, wait: float = 0.0) -> str | None:
        """Why the server is gone (its exit and last log line), or None while it runs; waits up to
        `wait` seconds for it to end (a dying server resets its connections before it is reaped)."""
        try:
            code = self.proc.wait(wait) if wait else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if code is None:
            return None
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        last = f", its log's last line: {lines[-1].strip()[:200]}" if lines else ""
        return f"{exit_reason(code)} (log {self.log}{last})"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode in (0, -signal.SIGTERM):
            self.log.unlink(missing_ok=True)
