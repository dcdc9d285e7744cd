"""Reading the default telemetry export back: OTLP/JSON lines, one file per process.

Each line is parsed into the OTLP protobuf `TracesData`, so a line that is not valid
OTLP/JSON fails loudly instead of being half-read. OTLP/JSON writes trace and span ids
as hex, where protobuf's own JSON mapping expects base64; they are converted first.
Lines cut short by a process killed while writing are skipped and counted.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
from google.protobuf import json_format
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status, TracesData

from pipeline.observability.export_files import EXPORT
from pipeline.observability.request_ids import ambiguous, request_key

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


class SpanRecord(msgspec.Struct, frozen=True):
    service: str
    pid: int  # the exporting process (resource attribute process.pid; 0 if absent)
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    status: str  # UNSET | OK | ERROR
    status_message: str


def _ids_to_base64(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: base64.b64encode(bytes.fromhex(v)).decode() if k in ID_FIELDS and v else _ids_to_base64(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_ids_to_base64(v) for v in node]
    return node


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(item) for item in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def parse_line(line: str) -> list[SpanRecord]:
    data = json_format.ParseDict(_ids_to_base64(json.loads(line)), TracesData())
    out = []
    for resource_spans in data.resource_spans:
        resource = {kv.key: value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    SpanRecord(
                        service=str(resource.get("service.name", "")),
                        pid=int(resource.get("process.pid", 0)),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={kv.key: value(kv.value) for kv in span.attributes},
                        events=[
                            {"name": e.name, **{kv.key: value(kv.value) for kv in e.attributes}}
                            for e in span.events
                        ],
                        status=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
                        status_message=span.status.message,
                    )
                )
    return out


def read_spans(paths: Iterable[Path]) -> tuple[list[SpanRecord], int]:
    """Every span in the files, and how many lines were unreadable (cut short)."""
    spans, bad = [], 0
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                spans.extend(parse_line(line))
            except (json.JSONDecodeError, json_format.ParseError):
                bad += 1
    return spans, bad


def trace_files(directory: Path) -> list[Path]:
    """Every process's span file, and their rotated older parts (`export_files`)."""
    return sorted(p for p in directory.glob("*.traces.jsonl*") if EXPORT.match(p.name))


# --- for people: `speclanes trace` ----------------------------------------------------


def traces(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """Spans by trace, each trace in start order."""
    out: dict[str, list[SpanRecord]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        out.setdefault(span.trace_id, []).append(span)
    return out


def find_trace(spans: list[SpanRecord], name: str) -> list[SpanRecord]:
    """The trace `name` names: a trace id, a request id its spans carry, the HTTP response's id
    (`chatcmpl-...`), or a unique prefix of one of these. LookupError if none; AmbiguousId, listing
    the requests, if the prefix fits several traces."""
    by_trace = traces(spans)
    names: dict[str, str] = {}  # every id that names a trace -> that trace's id
    for trace_id, trace in by_trace.items():
        names[trace_id] = trace_id
        names.update(
            (s.attributes["speclanes.request_id"], trace_id)
            for s in trace
            if s.attributes.get("speclanes.request_id")
        )
    key = request_key(name)
    if key in names:
        return by_trace[names[key]]
    fitting = sorted({trace for known, trace in names.items() if key and known.startswith(key)})
    if not fitting:
        raise LookupError(f"no trace or request with id {name!r}")
    if len(fitting) > 1:  # listed by request id where the trace has one
        requests = {trace: known for known, trace in names.items() if known != trace}
        raise ambiguous(name, [requests.get(trace, trace) for trace in fitting], "trace")
    return by_trace[fitting[0]]


def summary_rows(spans: list[SpanRecord]) -> list[dict[str, Any]]:
    """One row per request trace (those with a request root), oldest first. The request's root is the
    orchestrator's GenAI span, under the gateway's HTTP span or a caller's when there is one (the first
    choice's, for `n` > 1)."""
    rows = []
    for trace_id, trace in traces(spans).items():
        root = next((s for s in trace if "gen_ai.operation.name" in s.attributes), None)
        if root is None:
            continue
        rows.append(
            {
                "trace_id": trace_id,
                "request_id": root.attributes.get("speclanes.request_id", ""),
                "name": root.name,
                "spans": len(trace),
                "services": sorted({s.service for s in trace}),
                "seconds": (root.end_ns - root.start_ns) / 1e9,
                "output_tokens": root.attributes.get("gen_ai.usage.output_tokens", 0),
                "errors": sum(s.status == "ERROR" for s in trace),
            }
        )
    return rows


SHOWN = ("speclanes.step", "speclanes.k", "speclanes.accepted", "speclanes.batch_size", "speclanes.drafter")


def render_tree(trace: list[SpanRecord]) -> str:
    """The trace as an indented tree: offset from the root's start, duration, service, name."""
    children: dict[str, list[SpanRecord]] = {}
    ids = {s.span_id for s in trace}
    for span in trace:
        children.setdefault(span.parent_id if span.parent_id in ids else "", []).append(span)
    origin = min(s.start_ns for s in trace)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            extra = " ".join(
                f"{k.removeprefix('speclanes.')}={span.attributes[k]}" for k in SHOWN if k in span.attributes
            )
            error = f"  ERROR {span.status_message}" if span.status == "ERROR" else ""
            lines.append(
                f"{(span.start_ns - origin) / 1e6:9.1f} ms {(span.end_ns - span.start_ns) / 1e6:8.1f} ms  "
                f"{'  ' * depth}{span.name} [{span.service}] {extra}{error}".rstrip()
            )
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
