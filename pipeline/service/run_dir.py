"""The run directory: the user's alone, and home to one pipeline at a time.

It holds the sockets, the resolved configuration, the logs and the audit store, so another
local user must not read it, write it or plant it in advance:
- it is created 0700; an existing one must be a real directory owned by the user and not
  writable by group or others (one readable by others is tightened to 0700);
- the supervisor runs under umask 077, so every file and socket its processes make is 0600;
- the supervisor holds an exclusive `flock` on `supervisor.lock` for its whole life. A second
  supervisor fails at once, naming the first; `stop` signals only the lock's holder, after
  checking in /proc that it is a speclanes supervisor. The pid file is written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

LOCK_NAME, PID_NAME = "supervisor.lock", "supervisor.pid"
PRIVATE_UMASK = 0o077


class RunDirError(OSError):
    """A run directory that is not safe to use, or already in use."""


def secure(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"the run directory {path} is not a directory (a symlink?): refusing it")
    if info.st_uid != os.getuid():
        raise RunDirError(f"the run directory {path} belongs to uid {info.st_uid}, not to you: refusing it")
    if info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        raise RunDirError(f"the run directory {path} is writable by others (mode {mode:o}): refusing it")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def pid_path(run_dir: Path) -> Path:
    return run_dir / PID_NAME


def _open_lock(run_dir: Path) -> int:
    return os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)


class RunLock:
    """Held by the supervisor from before it touches anything in the directory until it exits
    (the kernel releases it if the process dies, whatever the signal)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.fd = secure(run_dir), -1

    def acquire(self) -> None:
        fd = _open_lock(self.run_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = running_supervisor(self.run_dir)
            raise RunDirError(
                f"a pipeline is already running in {self.run_dir} (supervisor pid {holder or '?'}); "
                "stop it with `speclanes stop`, or use another run.dir"
            ) from None
        self.fd = fd
        staging = self.run_dir / f".{PID_NAME}.{os.getpid()}"
        staging.unlink(missing_ok=True)
        out = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(out, "w") as file:
            file.write(str(os.getpid()))
        os.replace(staging, pid_path(self.run_dir))  # readers see the old pid or the new, never half

    def release(self) -> None:
        if self.fd >= 0:
            pid_path(self.run_dir).unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1


def running_supervisor(run_dir: Path) -> int | None:
    """The pid of the supervisor holding the run directory, or None when no pipeline runs there
    (0 if one does but its pid file is unreadable)."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            with contextlib.suppress(OSError, ValueError):
                return int(pid_path(run_dir).read_text())
            return 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def is_supervisor(pid: int) -> bool:
    """Whether `pid` is a `speclanes start` supervisor of this user (checked before signalling it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    command = any(a == b"pipeline.cli" or a == b"speclanes" or a.endswith(b"/speclanes") for a in argv)
    return owner == os.getuid() and command and b"start" in argv
