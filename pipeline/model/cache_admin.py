"""`speclanes cache verify` and `speclanes cache clear`: the weight cache, for operators.

Every entry is derived from a model file or from the kernels' sources, so clearing loses nothing
but the time to prepare them again; verifying checks each sealed entry against its seal (hashing
every file: about a second per GB), and names what is damaged or unsealed (an older format's).
A damaged entry is rebuilt anyway by the next process that needs it (`store.intact`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline.model.sealed import SEAL, SUFFIX, directory_problem, file_problem
from pipeline.model.store import is_digest


def _files(root: Path) -> Iterator[tuple[Path, str | None]]:
    """(entry, problem or None) for every sealed single file or memo below `root`."""
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name.endswith((SUFFIX, ".tmp")):
            continue
        if path.parent.name == "hashes":
            ok = is_digest(path.read_text(errors="replace").strip())
            yield path, None if ok else "not a SHA-256 digest (it is hashed again when next needed)"
        elif path.with_name(path.name + SUFFIX).exists():
            yield path, file_problem(path, trust_stamp=False)
        else:
            yield path, "unsealed (an older cache format: `speclanes cache clear` removes it)"


def entries(root: Path) -> Iterator[tuple[Path, str | None]]:
    """Every cache entry below `root` with what is wrong with it, or None."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / SEAL).exists():
            yield path, directory_problem(path, trust_stamp=False)
        elif path.is_dir():
            yield from _files(path)
        elif path.with_name(path.name + SUFFIX).exists():  # a single-file form (the torch packing)
            yield path, file_problem(path, trust_stamp=False)
        elif not path.name.endswith((SUFFIX, ".tmp")):
            yield path, "not a cache entry"


def clear(root: Path) -> int:
    """Remove every entry below `root`; the bytes freed."""
    if not root.is_dir():
        return 0
    freed = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    for path in root.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return freed
