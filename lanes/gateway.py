"""The gateway lane: the OpenAI-compatible HTTP server (pipeline/api/server.py) under the
supervisor like any lane (lifeline, heartbeats, restarts), on hypercorn's trio worker."""

from __future__ import annotations

import logging

import hypercorn.trio

from lanes.lane import LaneContext, lane_main
from pipeline.api.server import Gateway, exception_leaves, hypercorn_config

log = logging.getLogger(__name__)


async def serve(lane: LaneContext) -> None:
    gateway = Gateway(lane.config, lane.state, lane.telemetry)  # HTTP server spans: api/http_spans.py
    log.info("serving model %s over HTTP; orchestrator at %s", gateway.model, lane.config.addresses.client)
    settings = hypercorn_config(lane.config)
    try:
        await hypercorn.trio.serve(gateway.app(), settings)
    except* OSError as group:  # most often the port is taken: say so in one line, not a traceback
        leaves = [exc for exc in exception_leaves(group) if isinstance(exc, OSError)]
        log.error("cannot serve HTTP on %s: %s", settings.bind[0], leaves[0] if leaves else group)
        raise SystemExit(1) from None
    finally:
        gateway.client.close()


def main() -> None:
    lane_main("gateway", serve)


if __name__ == "__main__":
    main()
