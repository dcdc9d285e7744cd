"""A full disk is a condition, not an internal error.

The orchestrator writes its journal ahead of every step a client sees, and the audit lane writes
every event before acknowledging it. When the disk under the run directory fills (SQLite's
"database or disk is full", or ENOSPC), `StorageFull` says so, and the pipeline reacts instead
of failing:
- new requests are refused as `storage_full` (HTTP 503 with Retry-After) and /health says why;
- a request whose step cannot be journaled ends there with the finish reason `storage_full`
  (an error event and [DONE] for its client, never a hang); what is finished, the audit outbox
  and the counters stay in memory until the journal takes them again;
- the audit lane keeps events it could not write unacknowledged, so the orchestrator sends them
  again, and nothing acknowledged is ever lost.
`storage.min_free_bytes` refuses new work before the disk is full at all. The guard looks at the
free space and probes the journal every second, so the pipeline takes new work again by itself
within seconds of space returning.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.protocol.messages import ErrorReply

CHECK_SECONDS = 1.0


class StorageFull(RuntimeError):
    """A write failed for want of space."""


def is_full(exc: BaseException) -> bool:
    """A write refused for want of space: SQLite's SQLITE_FULL ("database or disk is full"), or
    its SQLITE_IOERR when the WAL cannot grow, or ENOSPC/EDQUOT from the OS."""
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return "full" in text or "no space" in text or "disk i/o error" in text
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@dataclass
class StorageGuard:
    """Whether the run directory's disk can take new work, from its free space and the last write."""

    directory: Path
    min_free_bytes: int
    reason: str = ""  # "" while new work is taken
    write_failed: str = ""  # the last failed write's error, until a probe write succeeds
    checked_at: float = -float("inf")

    def failed(self, exc: BaseException) -> None:
        self.write_failed = str(exc) or type(exc).__name__
        self.reason = f"storage full: {self.write_failed}"

    def check(self, now: float, probe: Callable[[], object]) -> None:
        """Every CHECK_SECONDS: the free space against `min_free_bytes`, and after a failed write a
        probe (`probe()` writes a little to the journal and raises if it cannot)."""
        if now - self.checked_at < CHECK_SECONDS:
            return
        self.checked_at = now
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError as exc:
            self.reason = f"storage unavailable: {exc}"
            return
        if free < self.min_free_bytes:
            self.reason = (
                f"storage low: {free} bytes free, under storage.min_free_bytes ({self.min_free_bytes})"
            )
            return
        if self.write_failed:
            try:
                probe()
            except Exception as exc:  # still full, or another error: stays refused
                self.failed(exc)
                return
            self.write_failed = ""
        self.reason = ""

    def refusal(self) -> ErrorReply | None:
        return ErrorReply(kind="storage_full", message=self.reason) if self.reason else None
