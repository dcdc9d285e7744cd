"""A full disk is a condition, not an internal error: the run directory on a small tmpfs.

A real pipeline (every lane and the HTTP gateway) serves from a run directory on an 24 MiB tmpfs.
The disk is then filled to the last byte while 28 requests (streamed and whole) arrive. None may
get an HTTP 500 or hang: each completes, is refused with 503, or (streamed) ends with an error
event and [DONE], within 5 s. When the filler goes, /health is 200 again within 10 s, and every
request that was answered 200 passes `audit verify`. Mounting a tmpfs needs root: skipped clearly
without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .pipeline_harness import Pipeline

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the full-disk test needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def request(url: str, body: dict, timeout: float) -> tuple[int, list, dict]:
    """Status, SSE events (streamed) and JSON body (whole), whatever the status."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            if body.get("stream"):
                events = [
                    line.decode().removeprefix("data: ").strip()
                    for line in reply
                    if line.startswith(b"data: ")
                ]
                return reply.status, [e if e == "[DONE]" else json.loads(e) for e in events], {}
            return reply.status, [], json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, [], json.loads(exc.read())


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    try:
        out = filler.open("wb", buffering=0)
    except OSError as exc:  # once seen in a full CI run, not reproduced: say what took the room
        largest = sorted((p.stat().st_size, str(p)) for p in directory.rglob("*") if p.is_file())[-8:]
        message = f"the disk was full before the test filled it; largest files: {largest}"
        raise AssertionError(message) from exc
    # Unbuffered: a buffered file keeps what the disk refused and raises again when it is closed.
    with out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
    return filler


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_full_disk_refuses_or_ends_requests_cleanly_and_recovers_by_itself(small_disk):
    run = small_disk / "run"
    pipeline = Pipeline(run, ["storage.min_free_bytes=0", "audit.batch_seconds=0"])
    pipeline.start()
    url = f"{pipeline.gateway_url}/v1/chat/completions"
    model = pipeline.config.model_id()
    served: list[str] = []
    outcomes: list[tuple[int, float, str]] = []
    try:

        def one(i: int, stream: bool) -> None:
            body = {
                "model": model, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 12,
                "temperature": 0, "stream": stream,
            }  # fmt: skip
            began = time.monotonic()
            status, events, whole = request(url, body, timeout=30)
            seconds = time.monotonic() - began
            if status == 200 and stream:
                errors = [e["error"]["code"] for e in events if isinstance(e, dict) and "error" in e]
                assert events and events[-1] == "[DONE]", events
                kind = errors[0] if errors else "completed"
                if not errors:
                    served.append(next(e["id"] for e in events if isinstance(e, dict)))
            elif status == 200:
                kind = "completed"
                served.append(whole["id"])
            else:
                kind = whole["error"]["code"]
            outcomes.append((status, seconds, kind))

        for i in range(2):  # the disk has room: served
            one(i, stream=i % 2 == 0)
        filler = fill(small_disk)
        threads = [threading.Thread(target=one, args=(i, i % 2 == 0)) for i in range(28)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join(60)
        assert len(outcomes) == 30
        assert all(status in (200, 503) for status, _, _ in outcomes), outcomes  # never a 500
        assert all(seconds < 5 for _, seconds, _ in outcomes), outcomes  # never a hang
        assert {kind for _, _, kind in outcomes} <= {"completed", "storage_full"}, outcomes
        assert any(kind == "storage_full" for _, _, kind in outcomes), outcomes  # the disk did fill
        filler.unlink()
        freed = time.monotonic()
        while health(pipeline.gateway_url) != 200:
            assert time.monotonic() - freed < 10, "not healthy 10 s after space returned"
            time.sleep(0.2)
        print(f"healthy {time.monotonic() - freed:.1f} s after space returned; outcomes: "
              f"{sorted(kind for _, _, kind in outcomes)}")  # fmt: skip
        one(99, stream=False)
        assert outcomes[-1][2] == "completed"
        pipeline.wait_until(lambda r: r.audit_pending == 0, timeout=20, what="the audit outbox drained")
    finally:
        pipeline.stop()
    db = str(run / "audit.sqlite")
    for response_id in served:
        verify = [sys.executable, "-m", "pipeline.cli", "audit", "verify", response_id, "--db", db]
        done = subprocess.run(verify, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (response_id, done.stdout[-500:], done.stderr[-500:])
