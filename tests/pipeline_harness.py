"""Start a real pipeline (supervisor, its four lanes and the HTTP gateway) in a private run
directory, with the gateway on a free loopback port so pipelines never share one."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from pipeline.audit.store import AuditStore
from pipeline.protocol.client import Client
from pipeline.protocol.config import Config, load_config
from pipeline.protocol.messages import SpeculativeEvent, StatusReport
from pipeline.service.launch import launch, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pipeline:
    def __init__(self, run_dir: Path, settings: list[str], env: dict[str, str] | None = None) -> None:
        self.run_dir, self.env = run_dir, {**os.environ, **(env or {})}
        self.settings = [f"run.dir={run_dir}", f"gateway.port={free_port()}", *settings]
        self.config: Config = load_config(None, self.settings, environ={})
        self.gateway_url = f"http://{self.config.gateway.host}:{self.config.gateway.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        self.proc, _ = launch(self.settings, env=self.env, timeout=timeout)

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.config.addresses.client, timeout=timeout, tls=self.config.tls)

    def status(self) -> StatusReport:
        with self.client(timeout=10.0) as c:
            return c.status()

    def lane(self, name: str):
        return self.status().lane(name)

    def wait_until(self, predicate, timeout: float = 30.0, what: str = "condition") -> StatusReport:
        deadline = time.monotonic() + timeout
        while True:
            report = self.status()
            if predicate(report):
                return report
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {msgspec.json.encode(report).decode()}")
            time.sleep(0.1)

    def wait_lane_up(self, name: str, old_pid: int | None, timeout: float = 30.0) -> None:
        def ready(report: StatusReport) -> bool:
            lane = report.lane(name)
            return lane.state == "up" and lane.pid != old_pid

        self.wait_until(ready, timeout, f"{name} lane back up")

    def audit_rows(self, request_id: str) -> list[tuple[str, int | None, str]]:
        db = sqlite3.connect(self.config.audit.path)
        try:
            return db.execute(
                "SELECT event_id, step, type FROM events WHERE request_id = ? ORDER BY step", (request_id,)
            ).fetchall()
        finally:
            db.close()

    def summary(self, request_id: str, timeout: float = 20.0) -> SpeculativeEvent:
        """The request's closing record in the audit store, as the pipeline served it (requests
        are readable through the client socket only with their submitter's secret)."""
        deadline = time.monotonic() + timeout
        while True:
            store = AuditStore(self.config.audit.path, readonly=True)
            try:
                found = store.of_types(["SpeculativeEvent"], request_id)
            finally:
                store.close()
            if found:
                assert isinstance(found[0], SpeculativeEvent)
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no summary of {request_id} in the audit store")
            time.sleep(0.1)

    def events(self, request_id: str) -> list:
        """Every audit event of a finished request, once its closing record is in the store."""
        self.summary(request_id)
        store = AuditStore(self.config.audit.path, readonly=True)
        try:
            return store.events(request_id)
        finally:
            store.close()

    def child_pids(self) -> list[int]:
        return [lane.pid for lane in self.status().lanes if lane.pid]

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie still answers kill(0): check its state
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


@contextlib.contextmanager
def running_pipeline(
    run_dir: Path, settings: list[str], env: dict[str, str] | None = None
) -> Iterator[Pipeline]:
    pipeline = Pipeline(run_dir, settings, env)
    try:
        pipeline.start()
        yield pipeline
    finally:
        pipeline.stop()
