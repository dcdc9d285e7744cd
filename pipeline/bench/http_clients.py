"""Completions streamed over HTTP (SSE), timed as a client sees them: the benchmarks' one HTTP client,
for speclanes' gateway and llama-server alike (`bench peers`, `bench pipeline`).

A request goes out with `stream: true` and `stream_options.include_usage`. The client counts the new
tokens from the final `usage` (both servers send it), joins the text of the chunks (`text` for
completions, `delta.content` for chat), and notes when the first text and every later piece arrive.
httpx does the HTTP; this module only reads the `data:` lines of the event stream. N clients at once
are N threads, each with its own connection, started together (`together`).
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx

from pipeline.bench.together import together

DONE = "[DONE]"


class StreamError(RuntimeError):
    """A stream that failed: an HTTP error status, an error event, or no usage at its end."""


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of an event stream's `data:` lines, until `[DONE]`; blank separators,
    comments and other fields are skipped."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == DONE:
            return
        yield json.loads(data)


def piece(event: dict[str, Any]) -> str:
    """The text one chunk adds: `text` in a completions chunk, `delta.content` in a chat chunk."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def summarise_stream(timed: Iterable[tuple[float, dict[str, Any]]], start: float) -> dict[str, Any]:
    """What a client saw of one stream, from (arrival time, event) pairs and the time it was sent:
    the text, the new tokens and prompt tokens (`usage`), the seconds to the last event and to the
    first text, and the gaps between successive arrivals of text."""
    texts, arrivals, usage, last = [], [], None, start
    for now, event in timed:
        if "error" in event:
            raise StreamError(f"error event: {json.dumps(event['error'])[:300]}")
        if text := piece(event):
            texts.append(text)
            arrivals.append(now)
        usage = event.get("usage") or usage
        last = now
    if usage is None:
        raise StreamError("the stream ended without usage (stream_options.include_usage)")
    seconds = max(last - start, 1e-9)
    count = int(usage["completion_tokens"])
    return {
        "text": "".join(texts), "count": count, "prompt_count": int(usage["prompt_tokens"]),
        "seconds": seconds, "tokens_per_second": count / seconds,
        "first_token_seconds": arrivals[0] - start if arrivals else seconds,
        "gaps": [b - a for a, b in itertools.pairwise(arrivals)],
    }  # fmt: skip


def stream(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request to `url`, timed from sending it to its last event."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise StreamError(f"HTTP {response.status_code} from {url}: {response.text[:300]}")
        events = ((time.perf_counter(), event) for event in sse_events(response.iter_lines()))
        return summarise_stream(events, start)


def new_client(timeout: float = 120.0) -> httpx.Client:
    """A client for one stream at a time: a long read timeout, as a whole answer may take a while."""
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))


def concurrently(url: str, work: list[list[dict[str, Any]]]) -> tuple[list[list[dict[str, Any]]], float]:
    """Each client's list of request bodies sent in turn by a client of its own (a thread with its own
    connection), all clients started together. Returns each client's results in its order, and the
    wall time from the first client's start to the last one's end. The first error is raised."""

    def one_client(index: int, ready: Callable[[], None]) -> list[dict[str, Any]]:
        with new_client() as client:
            ready()
            return [stream(client, url, body) for body in work[index]]

    return together(len(work), one_client)


def wait_healthy(base_url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Until GET /health answers 200 (the model is loaded); raises if `alive()` turns false first
    or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise StreamError(f"{base_url} exited before it was ready")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise StreamError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
