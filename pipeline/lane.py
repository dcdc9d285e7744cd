"""What every lane process shares: the lifeline, heartbeats and fault reports on the
control lane, and the entry point `python -m lanes.<name> CONFIG.json [--lifeline]`.

The lifeline is the supervisor's end of a pipe on our stdin: when it closes (the
supervisor exited or was killed) we exit too, so a killed supervisor leaves no orphans.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import trio

from .config import Config
from .messages import Fault, FaultKind, Heartbeat, SpeculativeState
from .transport import Outbox

log = logging.getLogger(__name__)


class LaneContext:
    def __init__(self, name: str, config: Config) -> None:
        self.name, self.config, self.pid = name, config, os.getpid()
        self.state = SpeculativeState()
        self.control = Outbox(config.addresses.control)

    def fault(
        self, kind: FaultKind, message: str, request_id: str | None = None, step: int | None = None
    ) -> None:
        """Report on the control lane without waiting: a fault report must never stall a lane."""
        log.warning("%s fault %s: %s", self.name, kind, message)
        fault = Fault(
            kind=kind, lane=self.name, message=message, request_id=request_id, step=step, time=time.time()
        )
        self.control.put_nowait(fault)

    def heartbeat(self) -> None:
        self.control.put_nowait(Heartbeat(lane=self.name, pid=self.pid, state=self.state))

    async def beat(self) -> None:
        while True:
            self.heartbeat()
            await trio.sleep(self.config.run.heartbeat_seconds)


async def _watch_lifeline(cancel: trio.CancelScope) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    while await stdin.receive_some(1024):
        pass
    log.info("lifeline closed: exiting")
    cancel.cancel()


def load_resolved(path: str) -> Config:
    return msgspec.json.decode(Path(path).read_bytes(), type=Config)


def lane_main(name: str, serve: Callable[[LaneContext], Awaitable[None]]) -> None:
    parser = argparse.ArgumentParser(prog=f"speclanes-{name}")
    parser.add_argument("config", help="resolved configuration (JSON, written by the supervisor)")
    parser.add_argument("--lifeline", action="store_true", help="exit when stdin closes")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s"
    )
    config = load_resolved(args.config)

    async def run() -> None:
        lane = LaneContext(name, config)
        async with trio.open_nursery() as nursery:
            if args.lifeline:
                nursery.start_soon(_watch_lifeline, nursery.cancel_scope)
            nursery.start_soon(lane.beat)
            await serve(lane)
            nursery.cancel_scope.cancel()

    trio.run(run)
