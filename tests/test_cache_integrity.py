"""Damaged caches: a flipped or cut cache file is rebuilt from the model file, never served.

Real `speclanes generate` processes on a tiny Q4_K_M model with a private cache: a clean run, then
one run after each damage to each kind of cached file (the front's embedding rows, the native
tiles and manifest, the compiled kernel library, the torch packing, the float32 reference, the
GGUF's hash memo). Each later run
must print exactly the clean run's tokens and log-probabilities (which move with any weight) and
say so in one warning line, and leave a cache that checks clean again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.model import cache_admin
from pipeline.model.sealed import directory_problem, file_problem, seal_directory, seal_file

from .tinymodel import TinySpec, write_tiny_gguf


def generate(model: Path, cache: Path, backend: str = "native") -> tuple[dict, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "generate", "-m", str(model), "--backend", backend,
         "--drafter", "none", "--max-tokens", "6", "--ignore-eos", "--json", "--logprobs", "3",
         "one two three"],
        # plain decoding: the numpy reference is not row-invariant, and a drafter's block sizes
        # follow the measured (load-dependent) cost of rows
        capture_output=True, text=True, timeout=120, env={**os.environ, "SPECLANES_CACHE": str(cache)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return {"tokens": out["tokens"], "logprobs": out["logprobs"]}, done.stderr.strip().splitlines()


def flip(path: Path) -> None:
    """64 bytes inverted in the middle of the file, in place (as rot or a stray write would)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at : at + 64] = bytes(b ^ 0xFF for b in data[at : at + 64])
    with path.open("r+b") as f:
        f.write(data)


def cut(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def one_of(cache: Path, pattern: str) -> Path:
    found = sorted(cache.glob(pattern))
    assert found, pattern
    return found[0]


TARGETS = {  # what is damaged: (the backend that reads it, where it is)
    "front embedding": ("native", "*-front-*/embed.npy"),
    "native weights": ("native", "*-native-*/0.wqkv.0.npy"),
    "native manifest": ("native", "*-native-*/manifest.json"),
    "kernel library": ("native", "native/*/rowkernels.so"),
    "torch weights": ("torch:bf16", "*-torch-bf16-*.pt"),
    "reference weights": ("numpy", "*-v2/wqkv.npy"),  # the float32 oracle's
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The model, a cache per backend's run and each run's clean answer. The numpy backend gets a
    cache of its own: its float32 reference, once there, is where every backend reads its front."""
    root = tmp_path_factory.mktemp("cache-integrity")
    model = root / "tiny.gguf"
    write_tiny_gguf(model, TinySpec(quant="Q4_K_M", d_model=256, d_ff=512, seed=7))
    caches, want = {}, {}
    for backend in {backend for backend, _ in TARGETS.values()}:
        caches[backend] = root / ("cache-numpy" if backend == "numpy" else "cache")
        want[backend], lines = generate(model, caches[backend], backend)
        assert not [line for line in lines if "damaged" in line]
    return model, caches, want


@pytest.mark.slow
@pytest.mark.parametrize("damage", [flip, cut], ids=["flipped", "cut"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_damaged_cache_file_is_rebuilt_and_the_answer_is_unchanged(clean, target, damage):
    model, caches, wants = clean
    backend, pattern = TARGETS[target]
    cache = caches[backend]
    damage(one_of(cache, pattern))
    got, lines = generate(model, cache, backend)
    assert got == wants[backend]
    warnings = [line for line in lines if "is damaged" in line]
    assert len(warnings) == 1, lines
    assert "rebuilding" in warnings[0]
    assert [problem for _, problem in cache_admin.entries(cache) if problem] == []  # rebuilt and sealed


@pytest.mark.slow
def test_a_damaged_hash_memo_is_hashed_again(clean):
    model, caches, want = clean
    cache = caches["native"]
    (memo,) = (cache / "hashes").iterdir()
    memo.write_text("not a digest")
    got, _ = generate(model, cache)
    assert got == want["native"] and memo.read_text() != "not a digest"


def test_a_damaged_calibration_is_measured_again(tmp_path, monkeypatch, caplog):
    """The cost model's stored t(rows) curve: a digit changed in place (same size) is caught by its
    checksum, with one warning, and the curve is measured again rather than trusted."""
    import logging

    from pipeline.model import calibration, load_model
    from pipeline.model.store import form_directory

    monkeypatch.setenv("SPECLANES_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(quant="Q8_0", seed=3))
    model = load_model(path, "native")
    rows = max(calibration.ROWS)
    monkeypatch.setattr(calibration, "measure", lambda *_: [0.25] * rows)
    assert calibration.stored_row_seconds(model, path) == [0.25] * rows
    (entry,) = form_directory(path, "calibration").glob("*.json")
    entry.write_text(entry.read_text().replace("0.25", "0.75", 1))  # same size, a cheaper-looking curve
    monkeypatch.setattr(calibration, "measure", lambda *_: [0.5] * rows)
    with caplog.at_level(logging.WARNING):  # a fresh process's model: nothing measured in memory yet
        assert calibration.stored_row_seconds(load_model(path, "native"), path) == [0.5] * rows
    assert len([r for r in caplog.records if "is damaged" in r.getMessage()]) == 1


def test_a_seal_trusts_an_unchanged_file_and_checks_a_rewritten_one(tmp_path):
    """The warm path: a file whose inode, size and mtime are unchanged is not hashed again; the
    same bytes rewritten (a copy, a restore) are hashed and trusted; other bytes are refused."""
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    seal_directory(tmp_path)
    assert directory_problem(tmp_path) is None
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)  # rewritten, same content
    assert directory_problem(tmp_path) is None
    (tmp_path / "a.bin").write_bytes(b"y" * 1000)
    assert "checksum" in directory_problem(tmp_path)
    single = tmp_path / "lib.so"
    single.write_bytes(b"z" * 10)
    assert "no readable seal" in file_problem(single)
    seal_file(single)
    assert file_problem(single) is None
    single.write_bytes(b"z" * 9)
    assert "bytes" in file_problem(single)


def test_writers_sealing_one_file_at_once_all_succeed(tmp_path):
    """Two lanes may build and seal the kernels at the same moment on a fresh machine: each writes
    the seal through a staging file of its own, so neither finds its staging file taken away."""
    target = tmp_path / "kernels.so"
    target.write_bytes(b"\x7fELF" * 64)
    errors: list[BaseException] = []

    def seal_often() -> None:
        try:
            for _ in range(40):
                seal_file(target)
        except BaseException as exc:  # any failure is the test's finding
            errors.append(exc)

    writers = [threading.Thread(target=seal_often) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == [] and file_problem(target) is None
    assert {p.name for p in tmp_path.iterdir()} == {target.name, target.name + ".seal"}  # no staging left


def test_cache_verify_and_clear_for_operators(tmp_path, monkeypatch, capsys):
    """`speclanes cache verify` hashes every sealed entry (exit 1 on damage, naming it) and
    `speclanes cache clear` empties the cache."""
    from pipeline.cli import main

    monkeypatch.setenv("SPECLANES_CACHE", str(tmp_path))
    form = tmp_path / "abc-native-v5"
    form.mkdir()
    (form / "w.npy").write_bytes(b"w" * 4096)
    seal_directory(form)
    library = tmp_path / "native" / "key" / "rowkernels.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF" + b"k" * 100)
    seal_file(library)
    assert main(["cache", "verify"]) == 0
    assert "0 damaged entries" in capsys.readouterr().out
    with library.open("r+b") as f:  # same size, same mtime resolution: only a full hash sees it
        f.seek(10)
        f.write(b"K")
    assert main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  {library}: rowkernels.so does not match its checksum" in out
    assert "1 damaged entry" in out
    assert main(["cache", "clear"]) == 0
    assert not list(tmp_path.iterdir())
