"""What every lane process shares: the lifeline, heartbeats and fault reports on the
control lane, and the entry point `python -m lanes.<name> CONFIG.json [--lifeline]`.

The lifeline is the supervisor's end of a pipe on our stdin: when it closes (the
supervisor exited or was killed) we exit too, so a killed supervisor leaves no orphans.
SIGTERM (the supervisor's stop) and a closed lifeline both end the process through the
same path, which flushes its telemetry: only a lane killed outright loses spans.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio
from opentelemetry.sdk.metrics.export import MetricReader

from pipeline.observability.process_stats import ProcessStats
from pipeline.observability.telemetry import Telemetry
from pipeline.protocol.config import HELPERS, Config
from pipeline.protocol.messages import Fault, FaultKind, Heartbeat, SpeculativeState
from pipeline.protocol.transport import Outbox
from pipeline.service.autogroup import set_autogroup_nice

log = logging.getLogger(__name__)
REPLY_BUFFER = 256  # replies a lane's data Outbox holds while its pipe writes the ones before
STARTING_SECONDS = 2.0  # a new lane's beats come faster for this long (`LaneContext.beat`)
STARTING_BEAT_SECONDS = 0.05


class LaneContext:
    def __init__(self, name: str, config: Config, telemetry: Telemetry) -> None:
        self.name, self.config, self.pid = name, config, os.getpid()
        self.state = SpeculativeState()
        self.runtime: dict[str, Any] = {}  # set by a lane that holds a model (see model.backends)
        # Buffered: a fault sent without waiting must not fail behind an audit acknowledgement.
        self.control = Outbox(config.addresses.control, config.tls, buffer=REPLY_BUFFER)
        self.telemetry = telemetry
        self.data: Outbox | None = None  # to the orchestrator's data inbox, for lanes that reply
        # False while the lane cannot serve yet (the gateway before its HTTP socket listens): it sends no
        # heartbeat, so nobody sees it "up" and connects to a port nothing listens on.
        self.serving = True

    def replies(self, address: str | None = None) -> Outbox:
        """The lane's Outbox for its replies: the orchestrator's data inbox, or `address` (the draft
        lane answers the verify lane). Heartbeats wait until it is connected: "up" must mean that a
        reply sent now arrives, and a restarted lane's dialer may still be in its reconnect back-off
        when its first heartbeat would go out (a draft then is lost)."""
        # A burst of replies (drafts for 8 requests at once) must not fail behind each other.
        self.data = Outbox(address or self.config.addresses.data, self.config.tls, buffer=REPLY_BUFFER)
        return self.data

    def fault(
        self,
        kind: FaultKind,
        message: str,
        request_id: str | None = None,
        step: int | None = None,
        trace: dict[str, str] | None = None,
    ) -> None:
        """Report on the control lane without waiting: a fault report must never stall a lane.
        The fault also goes into the request's trace (`trace`) or, with none, a trace of its own."""
        log.warning("%s fault %s: %s", self.name, kind, message)
        fault = Fault(
            kind=kind, lane=self.name, message=message, request_id=request_id, step=step, time=time.time()
        )
        self.control.put_nowait(fault)
        self.telemetry.fault(trace, kind, self.name, message, request_id=request_id, step=step)

    def heartbeat(self) -> None:
        if not self.serving or (self.data is not None and not self.data.connected()):
            return  # not serving or not reachable from here yet: not up
        # Its own CPU and memory: the orchestrator exports them but may not see this host's /proc.
        stats = ProcessStats.measure()
        beat = Heartbeat(lane=self.name, pid=self.pid, state=self.state, runtime=self.runtime, process=stats)
        self.control.put_nowait(beat)

    async def beat(self) -> None:
        """Heartbeats to the orchestrator, and a touch of this lane's alive file for the supervisor:
        both come from the event loop, so a stopped or hung lane stops both. For its first
        STARTING_SECONDS a lane beats every STARTING_BEAT_SECONDS: a beat counts only once both
        sockets between the lane and the orchestrator are connected, which a new lane cannot see
        from here, and a beat that came too early was one more `run.heartbeat_seconds` of a
        restart's stall (its requests wait for the lane to be up)."""
        alive = self.config.restart.alive_path(self.config.run.dir, self.name)
        every, started = self.config.run.heartbeat_seconds, trio.current_time()
        while True:
            self.heartbeat()
            with contextlib.suppress(OSError):
                alive.touch()
            starting = trio.current_time() - started < STARTING_SECONDS
            await trio.sleep(min(every, STARTING_BEAT_SECONDS) if starting else every)


async def _watch_lifeline(cancel: trio.CancelScope) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    while await stdin.receive_some(1024):
        pass
    log.info("lifeline closed: exiting")
    cancel.cancel()


async def _watch_signals(cancel: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: exiting", signal.Signals(signum).name)
            cancel.cancel()
            return


def load_resolved(path: str) -> Config:
    return msgspec.json.decode(Path(path).read_bytes(), type=Config)


def lane_main(
    name: str, serve: Callable[[LaneContext], Awaitable[None]], readers: Sequence[MetricReader] = ()
) -> None:
    """`readers`: metric readers of this process's own, beside the OTEL_* exporters."""
    parser = argparse.ArgumentParser(prog=f"speclanes-{name}")
    parser.add_argument("config", help="resolved configuration (JSON, written by the supervisor)")
    parser.add_argument("--lifeline", action="store_true", help="exit when stdin closes")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s"
    )
    config = load_resolved(args.config)
    if name in HELPERS and config.run.helper_nice:
        set_autogroup_nice(config.run.helper_nice)

    telemetry = Telemetry.configure(
        name, config.telemetry.dir, config.run_id(), readers=readers, rotation=config.telemetry.rotation()
    )

    async def run() -> None:
        lane = LaneContext(name, config, telemetry)
        async with trio.open_nursery() as nursery:
            if args.lifeline:
                nursery.start_soon(_watch_lifeline, nursery.cancel_scope)
            nursery.start_soon(_watch_signals, nursery.cancel_scope)
            nursery.start_soon(lane.beat)
            await serve(lane)
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        telemetry.shutdown()
