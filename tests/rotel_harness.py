"""A real OTLP receiver for tests: rotel's agent (from the `rotel` package on PyPI) on
loopback ports, printing what it receives to a debug log that is parsed back here.

The agent has no file exporter, so its detailed debug log is the record of what arrived;
the parser keeps what the tests compare: service, ids, name, status, attributes, events.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import rotel

from pipeline.service.launch import stop

from .pipeline_harness import free_port

AGENT = Path(rotel.__file__).parent / "rotel-agent"
FIELD = re.compile(r"^\s+(Trace ID|Parent ID|ID|Name|Status code|Status message)\s*: ?(.*)$")
ATTRIBUTE = re.compile(r"^\s+-> ([^:]+): (.*)$")
TYPED = re.compile(r"^(Str|Int|Double|Bool)\((.*)\)$")
ITEM = re.compile(r"(?:Str|Int|Double|Bool)\((.*?)\)(?:, |$)")  # one value of a Slice(...)


@dataclass
class ReceivedSpan:
    service: str
    pid: int = 0
    trace_id: str = ""
    parent_id: str = ""
    span_id: str = ""
    name: str = ""
    status: str = ""
    attributes: dict[str, str | list[str]] = field(default_factory=dict)
    events: list[dict[str, str | list[str]]] = field(default_factory=list)


def _plain(text: str) -> str | list[str]:
    """A value as the debug log prints it (`Int(3)`), bare; an array's (`Slice(Int(0), Int(3))`) as a
    list of them (the tests' arrays hold no ", " or ")")."""
    if text.startswith("Slice(") and text.endswith(")"):
        return ITEM.findall(text[len("Slice(") : -1])
    match = TYPED.match(text)
    return match.group(2) if match else text


def parse_debug_log(text: str) -> list[ReceivedSpan]:
    spans: list[ReceivedSpan] = []
    resource: dict[str, str] = {}
    mode = ""
    for line in text.splitlines():
        if line.startswith("ResourceSpans #"):
            resource, mode = {}, "resource"
        elif line.startswith("Span #"):
            spans.append(
                ReceivedSpan(
                    service=resource.get("service.name", ""), pid=int(resource.get("process.pid", 0))
                )
            )
            mode = "span"
        elif line.startswith("Attributes:"):
            mode = "span attributes"
        elif line.startswith("Events:"):
            mode = "events"
        elif line.startswith("SpanEvent #"):
            spans[-1].events.append({})
        elif mode == "span" and (match := FIELD.match(line)):
            key, value = match.group(1), match.group(2).strip()
            attr = {"Trace ID": "trace_id", "Parent ID": "parent_id", "ID": "span_id", "Name": "name"}
            if key in attr:
                setattr(spans[-1], attr[key], value)
            elif key == "Status code":
                spans[-1].status = value.removeprefix("STATUS_CODE_")
        elif match := ATTRIBUTE.match(line):
            key, value = match.group(1).strip(), _plain(match.group(2).strip())
            if mode == "resource":
                resource[key] = value
            elif mode == "span attributes":
                spans[-1].attributes[key] = value
            elif mode == "events" and spans[-1].events:
                spans[-1].events[-1][key.removeprefix("-> ")] = value
        elif line.startswith("Start time") or line.startswith("End time"):
            mode = "span"
    return spans


@dataclass
class Receiver:
    http_endpoint: str
    log: Path

    def spans(self) -> list[ReceivedSpan]:
        return parse_debug_log(self.log.read_text()) if self.log.exists() else []


@contextlib.contextmanager
def otlp_receiver(directory: Path) -> Iterator[Receiver]:
    """The agent in the foreground, its output (the debug log) going to a file."""
    grpc, http = free_port(), free_port()
    log = directory / "rotel.log"
    command = [
        str(AGENT), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc}",
        "--otlp-http-endpoint", f"127.0.0.1:{http}", "--exporter", "blackhole",
        "--debug-log", "traces", "--debug-log-verbosity", "detailed",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while "Starting Rotel" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rotel-agent did not start: {log.read_text(errors='replace')}")
            time.sleep(0.02)
        yield Receiver(f"http://127.0.0.1:{http}", log)
    finally:
        stop(proc)
