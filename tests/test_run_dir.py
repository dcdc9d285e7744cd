"""The run directory is private and holds one pipeline at a time (pipeline/service/run_dir.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.service.run_dir import RunDirError, RunLock, is_supervisor, pid_path, running_supervisor, secure

HOLD = """
import sys, time
from pathlib import Path
from pipeline.service.run_dir import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_run_directory_is_private(tmp_path):
    run_dir = secure(tmp_path / "a" / "run")
    assert mode(run_dir) == 0o700


def test_a_directory_readable_by_others_is_tightened(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    assert mode(secure(run_dir)) == 0o700


@pytest.mark.parametrize("bad_mode", [0o777, 0o775, 0o757])
def test_a_directory_others_can_write_is_refused(tmp_path, bad_mode):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, bad_mode)
    with pytest.raises(RunDirError, match="writable by others"):
        secure(run_dir)


def test_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(RunDirError, match="not a directory"):
        secure(tmp_path / "link")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another user")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, 65534, 65534)
    with pytest.raises(RunDirError, match="belongs to uid 65534"):
        secure(run_dir)


def test_one_lock_holder_at_a_time_and_the_kernel_frees_it_on_death(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
        assert running_supervisor(run_dir) == holder.pid == int(pid_path(run_dir).read_text())
        assert mode(pid_path(run_dir)) == 0o600 and mode(run_dir / "supervisor.lock") == 0o600
        started = time.monotonic()
        with pytest.raises(
            RunDirError, match=f"already running in {run_dir} \\(supervisor pid {holder.pid}\\)"
        ):
            RunLock(run_dir).acquire()
        assert time.monotonic() - started < 2
        assert not is_supervisor(holder.pid)  # a python -c holder is not `speclanes start`: stop leaves it
    finally:
        holder.kill()
        holder.wait()
    assert running_supervisor(run_dir) is None  # SIGKILL released the lock
    lock = RunLock(run_dir)
    lock.acquire()
    assert running_supervisor(run_dir) == os.getpid()
    lock.release()
    assert running_supervisor(run_dir) is None and not pid_path(run_dir).exists()


# Another user cannot list or read the run directory of a real pipeline, nor dial its sockets:
# tests/test_hostile.py (in a parent directory that user can enter, so the run directory's own mode
# is what refuses them).
