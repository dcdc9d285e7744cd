"""The supervisor: starts the lanes and the orchestrator, restarts whatever dies.

Each child gets a lifeline (a pipe on its stdin that only we hold) and its own session,
so a terminal's Ctrl-C reaches only us and we shut the children down in order. A dead
child is announced on the control lane (LaneDown, a lane_down fault) and restarted with
exponential back-off; LaneUp follows, and is repeated every few seconds for every running child,
so an orchestrator that restarted learns every lane's pid and restart count again.
SIGINT/SIGTERM: SIGTERM every child, SIGKILL any still alive after the grace period. If we
are killed outright the lifelines close and the children exit on their own.

Supervision as in OTP: a child that dies more often than the restart intensity allows
(`restart.max_restarts` within `restart.within_seconds`) is failed, not restarted
(LaneFailed, with its own last error line). A failed draft, audit or gateway leaves the rest
serving, degraded; a failed verify lane or orchestrator leaves nothing worth serving, so the
pipeline stops and `supervise` returns why.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import trio
from opentelemetry.trace import Span

from pipeline.model.default import model_path
from pipeline.model.draft_head import head_file
from pipeline.model.store import load_front
from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.client import AsyncClient, PipelineError
from pipeline.protocol.config import ESSENTIAL, PREDECESSOR, Config
from pipeline.protocol.messages import Fault, LaneDown, LaneFailed, LaneUp, Shutdown
from pipeline.protocol.tls import check_files
from pipeline.protocol.transport import Outbox
from pipeline.service.intensity import RestartIntensity
from pipeline.service.launch import last_error
from pipeline.service.run_dir import PRIVATE_UMASK, RunLock

log = logging.getLogger(__name__)
REANNOUNCE_SECONDS = 2.0
UNDELIVERED_KEPT = 256
COURIER_PATIENCE = 1.0  # seconds one hand-over may wait before the courier logs and tries again
Announcement = LaneUp | LaneDown | LaneFailed | Fault | Shutdown

MODULES = {
    "orchestrator": "lanes.orchestrator",
    "verify": "lanes.verify",
    "draft": "lanes.draft",
    "audit": "lanes.audit",
    "gateway": "lanes.gateway",
}


UNREACHABLE_SECONDS = 5.0  # a drain stops waiting for an orchestrator silent this long
# `speclanes start`'s exit status after a drain that had to end requests (1: a lane failed)
DRAIN_CUT_EXIT = 3


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.run_dir = Path(config.run.dir)
        self.children: dict[str, trio.Process] = {}
        self.restart_counts: dict[str, int] = {}
        self.failed: dict[str, LaneFailed] = {}
        # What the control lane could not take (the orchestrator is down or restarting): delivered,
        # in order, once it can. The orchestrator's own death reaches its successor this way.
        self.undelivered: collections.deque[Announcement] = collections.deque(maxlen=UNDELIVERED_KEPT)
        self.wake_courier = trio.Event()
        self.control = Outbox(config.addresses.control, config.tls)
        self.telemetry = Telemetry.configure(
            "supervisor", config.telemetry.dir, config.run_id(), rotation=config.telemetry.rotation()
        )
        self.restarts = self.telemetry.meter.create_counter(
            "speclanes.lane.restarts", "{restart}", "Processes the supervisor restarted after they died"
        )
        self.lanes = trio.CancelScope()  # every keep_running: cancelled to stop the pipeline
        self.failure: str | None = None  # why the pipeline stopped itself (an essential lane failed)
        self.draining = False  # SIGTERM came: the drain runs, a second signal stops at once
        self.drain_cut = False  # the drain window ended requests: exit with DRAIN_CUT_EXIT
        self.hang_kills: dict[int, str] = {}  # pid -> why watch_heartbeat killed it

    def announce(self, message: Announcement) -> None:
        """Hand it over now if the control lane takes it and nothing waits before it; else it
        waits its turn for the courier."""
        if not self.undelivered and self.control.put_nowait(message):
            return
        self.undelivered.append(message)
        self.wake_courier.set()

    async def courier(self) -> None:
        """What the control lane could not take at once (a message still in flight on its pipe, the
        orchestrator restarting), delivered in order as soon as it can be."""
        while True:
            if not self.undelivered:
                self.wake_courier = trio.Event()
                await self.wake_courier.wait()
                continue
            try:
                await self.control.put(self.undelivered[0], timeout=COURIER_PATIENCE)
                self.undelivered.popleft()
            except trio.TooSlowError:
                log.info("control lane not connected; %d messages wait", len(self.undelivered))

    async def keep_running(self, name: str, config_path: Path) -> None:
        restart = self.config.restart
        backoff, restarts = restart.initial_backoff, 0
        restart_span: Span | None = None  # from a death until the replacement has started
        intensity = RestartIntensity(restart.max_restarts, restart.within_seconds)
        log_path = self.run_dir / f"{name}.log"
        log_file = log_path.open("ab")
        command = [sys.executable, "-m", MODULES[name], str(config_path), "--lifeline"]
        env: dict[str, str] | None = None  # the orchestrator's: how its predecessor died
        while True:
            since = os.fstat(log_file.fileno()).st_size  # where this process's own output begins
            proc = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
                env=env,
            )
            self.children[name], self.restart_counts[name] = proc, restarts
            started = time.monotonic()
            log.info("%s started (pid %d, restarts %d)", name, proc.pid, restarts)
            self.announce(LaneUp(lane=name, pid=proc.pid, restarts=restarts))
            if restart_span is not None:
                restart_span.set_attribute("speclanes.lane.new_pid", proc.pid)
                restart_span.end()
            async with trio.open_nursery() as watch:
                watch.start_soon(self.watch_heartbeat, name, proc, time.time())
                await proc.wait()
                watch.cancel_scope.cancel()
            killed_for = self.hang_kills.pop(proc.pid, None)
            if not intensity.allow(time.monotonic()):
                self.fail(name, proc, restarts, killed_for or last_error(log_path, since))
                return
            restarts += 1
            log.warning("%s (pid %d) exited with %s; restart %d", name, proc.pid, proc.returncode, restarts)
            death = LaneDown(lane=name, pid=proc.pid, returncode=proc.returncode, restarts=restarts)
            self.announce(death)
            if name == "orchestrator":  # no orchestrator hears the control lane now: tell its successor
                env = os.environ | {PREDECESSOR: msgspec.json.encode(death).decode()}
            self.restarts.add(1, {"speclanes.lane": name})
            restart_span = self.telemetry.start(
                f"lane restart {name}",
                attributes={
                    "speclanes.lane": name, "speclanes.lane.pid": proc.pid,
                    "speclanes.lane.returncode": proc.returncode or 0, "speclanes.lane.restarts": restarts,
                    "speclanes.lane.backoff_seconds": backoff,
                },
            )  # fmt: skip
            if time.monotonic() - started > restart.reset_after:
                backoff = restart.initial_backoff
            await trio.sleep(backoff)
            backoff = min(backoff * 2, restart.max_backoff)

    async def reannounce(self) -> None:
        """LaneUp again for every running child, LaneFailed for every failed one: what the control
        lane said while the orchestrator was down (restarting) is lost, and its history lives here."""
        while True:
            await trio.sleep(REANNOUNCE_SECONDS)
            if self.undelivered:
                continue  # nobody is listening: the next round announces them
            for name, proc in list(self.children.items()):
                if proc.returncode is None:
                    self.announce(LaneUp(lane=name, pid=proc.pid, restarts=self.restart_counts[name]))
            for failed in self.failed.values():
                self.announce(failed)

    async def watch_heartbeat(self, name: str, proc: trio.Process, started: float) -> None:
        """Kill a lane whose alive file has gone stale since it first beat (SIGSTOP, a hung event
        loop): its restart then re-primes what it held. A lane still loading has not beaten yet."""
        limit = self.config.restart.hang_seconds
        if limit <= 0:
            return
        path = self.config.restart.alive_path(self.config.run.dir, name)
        while True:
            await trio.sleep(min(1.0, limit / 4))
            try:
                touched = path.stat().st_mtime
            except OSError:
                continue
            silent = time.time() - touched
            if touched >= started and silent > limit:
                message = f"pid {proc.pid} has not beaten for {silent:.1f} s: killing it"
                log.warning("%s %s", name, message)
                self.announce(Fault(kind="timeout", lane=name, message=message, time=time.time()))
                self.hang_kills[proc.pid] = message
                proc.kill()
                return

    def fail(self, name: str, proc: trio.Process, restarts: int, reason: str) -> None:
        """Past the restart intensity: leave the lane down and say why, on the control lane and in
        a trace. An essential lane's failure stops the pipeline; any other's is announced again
        with every round of `reannounce`, so a restarted orchestrator learns it too."""
        restart = self.config.restart
        log.error(
            "%s (pid %d) exited with %s, more than restart.max_restarts = %d restarts within %g s: "
            "failed, not restarted: %s", name, proc.pid, proc.returncode, restart.max_restarts,
            restart.within_seconds, reason,
        )  # fmt: skip
        self.telemetry.fault(None, "lane_failed", name, reason)
        failed = LaneFailed(
            lane=name, pid=proc.pid, returncode=proc.returncode, restarts=restarts, reason=reason
        )
        self.announce(failed)
        self.failed[name] = failed  # announced again with every round of `reannounce`
        if name in ESSENTIAL:
            self.failure = f"the {name} lane failed (it died {restarts + 1} times): {reason}"
            log.error("stopping the pipeline: %s", self.failure)
            self.announce(Shutdown(reason=self.failure))
            self.lanes.cancel()

    async def drain(self, stop: trio.CancelScope) -> None:
        """Wait for the orchestrator to have nothing unfinished (it ends what is left when the
        window closes), give the gateway `flush_seconds` to send the last streams their error and
        [DONE], then stop everything. A drain that had to end requests stops the pipeline as failed
        (a non-zero exit)."""
        window = self.config.shutdown.drain_seconds
        deadline = trio.current_time() + window + self.config.shutdown.flush_seconds + 5.0
        client, ended = AsyncClient(self.config.addresses.client, timeout=2.0, tls=self.config.tls), 0
        answered = trio.current_time()
        try:
            while trio.current_time() < deadline:
                try:
                    report = await client.status(timeout=2.0)
                except PipelineError:  # restarting: its successor drains too; gone for good: stop
                    if trio.current_time() - answered > UNREACHABLE_SECONDS:
                        log.warning("the orchestrator does not answer: not waiting for a drain")
                        break
                    await trio.sleep(0.2)
                    continue
                answered, ended = trio.current_time(), report.ended_at_shutdown
                if report.active_requests + report.queued_requests == 0:
                    break
                await trio.sleep(0.1)
            else:
                ended = max(ended, 1)  # no answer that it drained: count it as cut short
            if ended:
                self.drain_cut = True
                self.failure = f"the drain window ({window:g} s) ended {ended} unfinished requests"
                log.warning("%s: ended the rest with a server_shutdown error", self.failure)
                await trio.sleep(self.config.shutdown.flush_seconds)
            else:
                log.info("drained: every in-flight request finished")
        finally:
            client.close()
            stop.cancel()

    async def stop_children(self) -> None:
        alive = [p for p in self.children.values() if p.returncode is None]
        for proc in alive:
            proc.terminate()
        with trio.move_on_after(self.config.restart.shutdown_grace):
            for proc in alive:
                await proc.wait()
        for proc in alive:
            if proc.returncode is None:
                log.warning("pid %d ignored SIGTERM: killing it", proc.pid)
                proc.kill()
                await proc.wait()

    async def run(self) -> str | None:
        """Until SIGINT/SIGTERM (None) or an essential lane's failure (why)."""
        config_path = self.run_dir / "config.json"
        config_path.write_bytes(msgspec.json.encode(self.config))
        # Prepare the config, tokenizer and embedding once here, not three times at once in the lanes
        # (each model lane then prepares or maps its backend's own weight form).
        models = [str(model_path(self.config.model.path))]
        if self.config.model.draft_path:
            models.append(self.config.model.draft_path)
        for model in models:
            await trio.to_thread.run_sync(load_front, Path(model))
        explicit, serving = self.config.model.draft_head, self.config.processes()
        if explicit and ("draft" in serving or "orchestrator" in serving):  # a wrong head fails `start` at
            target = load_front(Path(models[0]))  # once, not two lanes in a restart loop
            await trio.to_thread.run_sync(head_file, Path(models[0]), target.cfg, target.embed, explicit)
        try:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals, self.lanes:
                async with trio.open_nursery() as nursery:
                    for name in self.config.processes():
                        nursery.start_soon(self.keep_running, name, config_path)
                    nursery.start_soon(self.reannounce)
                    nursery.start_soon(self.courier)
                    drain = self.config.shutdown.drain_seconds
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        if signum == signal.SIGTERM and drain > 0 and not self.draining:
                            log.info("%s: draining (up to %g s), then shutting down", name, drain)
                            self.draining = True
                            self.announce(Shutdown(reason=name, drain_seconds=drain))
                            nursery.start_soon(self.drain, nursery.cancel_scope)
                            continue
                        log.info("%s: shutting down now", name)
                        self.announce(Shutdown(reason=name))
                        nursery.cancel_scope.cancel()
                        break
        finally:
            with trio.CancelScope(shield=True):
                await self.stop_children()
            self.telemetry.shutdown()
        return self.failure


def supervise(config: Config) -> tuple[str | None, int]:
    """Lock the run directory before anything else; every process started from here keeps its
    files private (umask 077). Returns why the pipeline stopped itself (None after a signal and a
    clean drain) and the exit status that says so: 0, 1 (an essential lane failed) or
    DRAIN_CUT_EXIT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
    check_files(config)  # a missing key fails `start` in one line, not every lane in a restart loop
    os.umask(PRIVATE_UMASK)
    lock = RunLock(Path(config.run.dir))
    lock.acquire()
    supervisor = Supervisor(config)
    try:
        failure = trio.run(supervisor.run)
    finally:
        lock.release()
    return failure, 0 if failure is None else DRAIN_CUT_EXIT if supervisor.drain_cut else 1
