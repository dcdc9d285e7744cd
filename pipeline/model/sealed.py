"""Seals on cached artifacts: a rotten or cut cache file is found before it is used, and rebuilt.

Every prepared form of a model (the front, the reference, the native tiles, the torch packing),
the compiled kernels and the calibration are derived from the GGUF (or the sources) alone, so a
damaged copy is never worth serving: a flipped byte in a weight file silently changes the answer,
in the kernel library it kills the process with SIGILL, and a cut file fails to map. Each is
sealed when it is written, with the SHA-256 and size of every file, and checked before it is used.

Hashing a form costs about a second per GB, so a check trusts a file whose inode, size and
modification time are those it had when its content last matched its seal (the seal records
them); anything that rewrites a file in place changes them, so it is hashed again. A seal is
written last, after every file is on disk (fsync), and renamed into place: a crash while writing
leaves no seal, which reads as damage and is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

SEAL = ".seal.json"  # in a sealed directory
SUFFIX = ".seal"  # beside a sealed single file


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _write_json(path: Path, value: Any) -> None:
    """Written whole or not at all, through a staging file of this writer's own: two processes that
    seal one file at once (two lanes building the kernels on a fresh machine) both succeed."""
    fd, staging = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)


def _entry(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        os.fsync(f.fileno())  # the content is on disk before the seal that vouches for it
    return {"sha256": _digest(path), "size": path.stat().st_size, "stamp": _stamp(path)}


def _problem(path: Path, entry: dict[str, Any], trust_stamp: bool) -> str | None:
    """Why `path` does not match its seal entry, or None (trusting an unchanged stamp if asked)."""
    try:
        stamp = _stamp(path)
    except OSError:
        return f"{path.name} is missing"
    if trust_stamp and stamp == entry.get("stamp"):
        return None
    if stamp[1] != entry.get("size"):
        return f"{path.name} is {stamp[1]} bytes, sealed at {entry.get('size')}"
    if _digest(path) != entry.get("sha256"):
        return f"{path.name} does not match its checksum"
    entry["stamp"] = stamp  # same content, rewritten or copied: trust this inode from now on
    return None


def seal_directory(directory: Path) -> None:
    """Seal every file in `directory` (not below it)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != SEAL)
    _write_json(directory / SEAL, {p.name: _entry(p) for p in files})


def directory_problem(directory: Path, trust_stamp: bool = True) -> str | None:
    """None when every file `directory`'s seal lists matches it; else what is wrong. With
    `trust_stamp=False` every file is hashed (`speclanes cache verify`)."""
    try:
        seal = json.loads((directory / SEAL).read_text())
    except (OSError, ValueError):
        return "it has no readable seal"
    if not isinstance(seal, dict) or not seal:
        return "its seal is empty"
    before = json.dumps(seal, sort_keys=True)
    for name, entry in seal.items():
        problem = (
            _problem(directory / name, entry, trust_stamp)
            if isinstance(entry, dict)
            else "its seal is damaged"
        )
        if problem:
            return problem
    if json.dumps(seal, sort_keys=True) != before:  # new stamps: skip the hash next time
        with contextlib.suppress(OSError):
            _write_json(directory / SEAL, seal)
    return None


def seal_file(path: Path) -> None:
    _write_json(path.with_name(path.name + SUFFIX), _entry(path))


def file_problem(path: Path, trust_stamp: bool = True) -> str | None:
    """None when `path` matches the seal beside it; else what is wrong."""
    seal_path = path.with_name(path.name + SUFFIX)
    try:
        entry = json.loads(seal_path.read_text())
    except (OSError, ValueError):
        return f"{path.name} has no readable seal"
    if not isinstance(entry, dict):
        return f"{path.name}'s seal is damaged"
    before = dict(entry)
    problem = _problem(path, entry, trust_stamp)
    if problem is None and entry != before:
        with contextlib.suppress(OSError):
            _write_json(seal_path, entry)
    return problem
