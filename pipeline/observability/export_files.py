"""The default file export's files, bounded: rotated by size, and pruned when their process is gone.

The file exporters append one OTLP/JSON line per batch to one file per process (its pid in the
name). Left alone, a pipeline writes about 1.6 KB of spans a decoding step: 17 GB a day at a
busy lane's pace, until the disk fills. So each file is the stream of a stdlib
`RotatingFileHandler`: past `file_max_bytes` it becomes `NAME.1` (the older `NAME.1` becomes
`NAME.2`, and so on up to `file_backups`), whole lines only. A process killed or restarted
leaves its files behind under its old pid: when a process starts its export, the files of
processes that are gone are deleted, oldest first, down to one process's share.

So the directory holds at most (processes alive + 1) x (file_backups + 1) x file_max_bytes per
signal, as long as a batch's line (512 spans: about 180 KB) fits in `file_max_bytes`: a file
rolls over before a line would take it past the size, and the setting is at least 1 MiB.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import NamedTuple

# NAME.PID.SIGNAL.jsonl, and its rotated NAME.PID.SIGNAL.jsonl.N
EXPORT = re.compile(r"^.+\.(?P<pid>\d+)\.(traces|metrics)\.jsonl(\.\d+)?$")


class Rotation(NamedTuple):
    max_bytes: int
    backups: int

    def share(self) -> int:
        """The most one process's files of one signal can hold."""
        return self.max_bytes * (self.backups + 1)


DEFAULT_ROTATION = Rotation(max_bytes=32 * 2**20, backups=2)  # the [telemetry] settings' defaults


class RotatingLines(io.TextIOBase):
    """A text stream that appends whole lines to `path`, rotated as the module says."""

    def __init__(self, path: Path, rotation: Rotation) -> None:
        self.handler = RotatingFileHandler(
            path, maxBytes=rotation.max_bytes, backupCount=rotation.backups, encoding="utf-8", delay=True
        )
        self.handler.terminator = ""  # the exporter's lines end in their own newline
        self.handler.setFormatter(logging.Formatter("%(message)s"))

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        # the record's message is the line itself (no arguments, so no %-formatting of it)
        self.handler.emit(logging.makeLogRecord({"msg": text, "args": None}))
        return len(text)

    def flush(self) -> None:
        self.handler.flush()

    def close(self) -> None:
        self.handler.close()
        super().close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune_departed(directory: Path, keep_bytes: int) -> list[Path]:
    """Delete export files of processes that are gone, oldest first, until theirs total at most
    `keep_bytes`; the deleted paths."""
    gone = []
    for path in directory.glob("*.jsonl*"):
        match = EXPORT.match(path.name)
        if match and not _alive(int(match["pid"])):
            with contextlib.suppress(OSError):
                gone.append((path.stat().st_mtime, path.stat().st_size, path))
    gone.sort()
    total, deleted = sum(size for _, size, _ in gone), []
    for _, size, path in gone:
        if total <= keep_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            deleted.append(path)
        total -= size
    return deleted
