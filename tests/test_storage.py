"""The orchestrator's side of a full disk, without processes (storage.py): a step that cannot be
journaled ends its request with `storage_full`; the guard refuses new work below
`storage.min_free_bytes` or after a failed write, and takes it again once a probe write succeeds."""

from __future__ import annotations

import sqlite3

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model
from pipeline.orchestration.storage import StorageFull, StorageGuard, is_full

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("storage") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


def test_a_step_the_journal_cannot_take_ends_its_request_with_storage_full(model, monkeypatch):
    world = World(model)
    world.up()
    request_id = world.submit("ab ab ab ab", params=SamplingParams(max_tokens=400, ignore_eos=True))
    world.run(until=8)
    assert world.result(request_id) is None

    def full(*_: object) -> None:
        raise StorageFull("database or disk is full")

    monkeypatch.setattr(world.hub.journal, "stepped", full)
    world.run(until=40)
    result = world.result(request_id)
    assert result is not None and result.finish_reason == "storage_full"
    assert request_id not in world.verifier.requests  # its lanes' state is freed


def test_the_guard_refuses_below_the_floor_and_after_a_failed_write_until_a_probe_succeeds(tmp_path):
    guard = StorageGuard(tmp_path, min_free_bytes=2**62)  # more than any disk has
    guard.check(0.0, probe=lambda: None)
    assert guard.refusal() is not None and "storage.min_free_bytes" in guard.reason
    guard.min_free_bytes = 0
    guard.check(0.5, probe=lambda: None)
    assert guard.refusal() is not None  # checked at most once a second
    guard.check(1.0, probe=lambda: None)
    assert guard.refusal() is None
    guard.failed(sqlite3.OperationalError("database or disk is full"))
    assert guard.refusal().kind == "storage_full"

    def still_full() -> None:
        raise StorageFull("database or disk is full")

    guard.check(2.0, probe=still_full)
    assert guard.refusal() is not None
    guard.check(3.0, probe=lambda: None)
    assert guard.refusal() is None


def test_what_counts_as_a_full_disk():
    import errno

    assert is_full(sqlite3.OperationalError("database or disk is full"))
    assert is_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_full(sqlite3.OperationalError("no such table: steps"))
    assert not is_full(OSError(errno.EACCES, "Permission denied"))
