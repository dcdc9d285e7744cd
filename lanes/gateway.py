"""The gateway lane: the OpenAI-compatible HTTP server (pipeline/api/server.py) under the
supervisor like any lane (lifeline, heartbeats, restarts), on hypercorn's trio worker."""

from __future__ import annotations

import functools
import logging

import hypercorn.trio
import trio

from lanes.lane import LaneContext, lane_main
from pipeline.api.server import Gateway, exception_leaves, hypercorn_config
from pipeline.protocol.messages import GatewayInbox
from pipeline.protocol.transport import Inbox

log = logging.getLogger(__name__)


async def serve(lane: LaneContext) -> None:
    """Up (its heartbeats) only once hypercorn listens: it runs the app's lifespan first, and a
    heartbeat sent meanwhile told clients to connect to a port that refused them."""
    lane.serving = False
    config = lane.config
    gateway = Gateway(config, lane.state, lane.telemetry)  # HTTP server spans: api/http_spans.py
    log.info("serving model %s over HTTP; orchestrator at %s", gateway.model, config.addresses.client)
    settings = hypercorn_config(config)
    # Streams' chunks arrive pushed onto the gateway's inbox, not polled for (protocol/push_feed.py).
    inbox: Inbox = Inbox(config.bind("gateway"), GatewayInbox, config.tls, config.admission.max_message_bytes)
    feed = gateway.client.receive_pushes(inbox)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.run)
            await nursery.start(functools.partial(hypercorn.trio.serve, gateway.app(), settings))
            lane.serving = True
            lane.heartbeat()
    except* OSError as group:  # most often the port is taken: say so in one line, not a traceback
        leaves = [exc for exc in exception_leaves(group) if isinstance(exc, OSError)]
        log.error("cannot serve HTTP on %s: %s", settings.bind[0], leaves[0] if leaves else group)
        raise SystemExit(1) from None
    finally:
        gateway.client.close()
        inbox.close()


def main() -> None:
    lane_main("gateway", serve)


if __name__ == "__main__":
    main()
