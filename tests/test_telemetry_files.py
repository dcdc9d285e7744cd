"""The default file export stays within its bound: files rotate by size, whole lines only, and
the files of processes that are gone are pruned to one process's share."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.observability.export_files import EXPORT, Rotation, prune_departed
from pipeline.observability.telemetry import Telemetry
from pipeline.observability.trace_files import read_spans, trace_files

FILES = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "OTEL_METRICS_EXPORTER": "none"}


def test_ten_thousand_steps_of_spans_stay_within_the_bound_and_stay_readable(tmp_path):
    """10,000 decoding steps' worth of spans (a step span with 3 attributes each, about 3.5 MB of
    lines) through the real exporter with a 1 MiB rotation: this process keeps at most
    backups + 1 files, none past the rotation size (a file rolls over before a line would take it
    past), and every line left is whole OTLP/JSON that `speclanes trace` reads."""
    rotation = Rotation(max_bytes=2**20, backups=2)
    telemetry = Telemetry.configure("verify", tmp_path, "run", environ=FILES, rotation=rotation)
    for step in range(10_000):
        with telemetry.span("verify step", attributes={"step": step, "k": 4, "accepted": 3}):
            pass
        if step % 1000 == 999:
            telemetry.tracer_provider.force_flush()
    telemetry.shutdown()
    files = trace_files(tmp_path)
    assert 1 < len(files) <= rotation.backups + 1
    assert all(f.stat().st_size <= rotation.max_bytes for f in files)
    spans, bad = read_spans(files)
    assert bad == 0 and len(spans) > 1000 and all(s.name == "verify step" for s in spans)


def test_files_of_processes_that_are_gone_are_pruned_oldest_first(tmp_path):
    """A crash loop leaves a file per dead pid; the next process to start its export deletes the
    oldest of them down to one process's share, and never touches a live process's file."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    for i in range(6):
        path = tmp_path / f"speclanes-verify.{dead_pid}.traces.jsonl.{i}"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    live = tmp_path / f"speclanes-draft.{os.getpid()}.traces.jsonl"
    live.write_bytes(b"y" * 5000)
    deleted = prune_departed(tmp_path, keep_bytes=2500)
    assert sorted(p.name[-1] for p in deleted) == ["0", "1", "2", "3"]  # the oldest four
    assert live.exists() and len(list(tmp_path.iterdir())) == 3
    assert all(EXPORT.match(p.name) for p in tmp_path.iterdir())
