"""A damaged journal is set aside with one warning, and the orchestrator starts on an empty one.

Three kinds of damage, as an operator's probe makes them: garbage in place of the file, a file
cut short, and damaged pages in the middle of a real journal. Each is checked on the function
the orchestrator calls at start (`open_journal`), and the garbage case on a real pipeline, which
must come up within 10 s, say so in its orchestrator log, and serve.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import pytest

from pipeline.orchestration.journal import FORMAT, Journal, OpenedRecord, journal_problem, open_journal

from .pipeline_harness import Pipeline


def journal_with_requests(path: Path, n: int = 200) -> None:
    """A real journal of several pages: n opened requests with long prompts."""
    journal = Journal(path)
    for i in range(n):
        record = OpenedRecord(
            request_id=f"r{i}", secret="s", submitted=0.0, prompt_tokens=list(range(200)), params={},
            speculation={}, seed=i,
        )  # fmt: skip
        journal.opened(record)
    journal.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    journal.close()


def garbage(path: Path) -> None:
    path.write_bytes(b"this is not a database\x00" * 500)


def cut(path: Path) -> None:
    journal_with_requests(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 3)


def damaged_pages(path: Path) -> None:
    journal_with_requests(path)
    data = bytearray(path.read_bytes())
    page = 4096
    for at in range(2 * page, min(len(data), 6 * page), page):  # b-tree pages' headers overwritten
        data[at : at + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [garbage, cut, damaged_pages])
def test_a_damaged_journal_is_moved_aside_with_one_warning(tmp_path, caplog, damage):
    path = tmp_path / "journal.sqlite"
    damage(path)
    assert journal_problem(path) is not None
    with caplog.at_level(logging.WARNING):
        journal = open_journal(path)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    (aside,) = tmp_path.glob("journal.sqlite.damaged-*")
    assert str(aside) in warning and "in-flight requests" in warning
    assert journal.recover().requests == []  # empty, and usable
    journal.opened(OpenedRecord(request_id="new", secret="s", submitted=0.0, prompt_tokens=[1], params={},
                                speculation={}, seed=0))  # fmt: skip
    assert [r.opened.request_id for r in journal.recover().requests] == ["new"]


def test_a_sound_journal_with_a_wal_left_by_a_kill_is_kept(tmp_path, caplog):
    """What crash recovery depends on: a journal whose last commits are still in its WAL (the
    orchestrator was SIGKILLed) is sound, not damaged."""
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    journal.opened(OpenedRecord(request_id="kept", secret="s", submitted=0.0, prompt_tokens=[1], params={},
                                speculation={}, seed=0))  # fmt: skip
    assert Path(f"{path}-wal").stat().st_size > 0  # not closed: as a killed process leaves it
    with caplog.at_level(logging.WARNING):
        reopened = open_journal(path)
    assert not caplog.records
    assert [r.opened.request_id for r in reopened.recover().requests] == ["kept"]


def test_a_journal_of_another_format_is_set_aside(tmp_path):
    path = tmp_path / "journal.sqlite"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {FORMAT + 1}")
    db.close()
    assert "format" in journal_problem(path)


@pytest.mark.slow
def test_the_next_start_on_a_garbage_journal_comes_up_within_10_s_and_serves(tmp_path):
    """A pipeline ran and stopped (its caches prepared, its calibration measured); its journal is
    then overwritten with garbage. The next start is up within 10 s, says so once in the
    orchestrator's log, and serves."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    pipeline = Pipeline(run, ["gateway.enabled=false"])
    pipeline.start()
    pipeline.stop()
    garbage(run / "journal.sqlite")
    began = time.monotonic()
    pipeline.start(timeout=30)
    try:
        up = time.monotonic() - began
        with pipeline.client() as client:
            assert client.complete("Hello", params={"max_tokens": 4}).tokens
        assert up < 10, up
        log = (run / "orchestrator.log").read_text()
        assert log.count("is damaged") == 1 and "journal.sqlite.damaged-" in log
    finally:
        pipeline.stop()
