"""OpenTelemetry for every process of the pipeline: one tracer and one meter each, a
`service.name` per process (`speclanes-orchestrator`, `speclanes-verify`, ...) over shared
resource attributes, and exporters chosen by the standard `OTEL_*` variables.

Nothing is dropped silently: with no OTLP endpoint configured, spans and metrics go as
OTLP/JSON lines to one file per process under the run directory (the contrib file
exporter), which any OTLP tool can load; those files rotate by size and are pruned when their
process is gone (`export_files`), so the directory stays within a bound. Spans are exported
from the SDK's batch thread, never on a request's critical path, and every process flushes on
its way out; only a process killed outright loses what it had not yet exported (at most one
export interval).

The variables read here (the SDK and the OTLP exporter read the rest themselves:
endpoint, headers, timeouts, batch sizes, `OTEL_SDK_DISABLED`, `OTEL_RESOURCE_ATTRIBUTES`):
- `OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`: comma lists of `otlp`,
  `otlp_json_file`, `console`, `none`, or any installed exporter entry point. Default:
  `otlp` when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the signal's own endpoint) is set, else
  `otlp_json_file`.
- `OTEL_EXPORTER_OTLP_PROTOCOL` (and the per-signal variants): `http/protobuf` only.
- `OTEL_SERVICE_NAME`: the prefix of each process's service name (default `speclanes`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pipeline import __version__
from pipeline.observability.export_files import DEFAULT_ROTATION, RotatingLines, Rotation, prune_departed

log = logging.getLogger(__name__)

SCOPE = "speclanes"
PROPAGATOR = TraceContextTextMapPropagator()
BAGGAGE = W3CBaggagePropagator()
# Baggage the gateway adds to a Submit's trace context: the prefix its response id puts before the
# request id (`chatcmpl-`), so the pipeline's root span names the id the client received.
RESPONSE_PREFIX = "speclanes.response_prefix"
DEFAULT_QUEUE = 65536  # spans held for the batch thread before it would drop one
DEFAULT_METRIC_INTERVAL_MS = 10_000  # the SDK's default (60 s) outlives most runs


class TelemetryError(ValueError):
    """An exporter setting that cannot be honoured (unknown name, unsupported protocol)."""


def namespace(environ: Mapping[str, str]) -> str:
    return environ.get("OTEL_SERVICE_NAME") or "speclanes"


def service_name(component: str, environ: Mapping[str, str]) -> str:
    return f"{namespace(environ)}-{component}"


def resource(component: str, run_id: str, environ: Mapping[str, str]) -> Resource:
    """Shared attributes (namespace, run, host, version) plus this process's own; the
    user's `OTEL_RESOURCE_ATTRIBUTES` are merged in by the SDK."""
    return Resource.create(
        {
            "service.name": service_name(component, environ),
            "service.namespace": namespace(environ),
            "service.version": __version__,
            "speclanes.run_id": run_id,
            "speclanes.component": component,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )


def _names(signal: str, environ: Mapping[str, str]) -> list[str]:
    configured = environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip()
    if configured:
        return [name.strip() for name in configured.split(",") if name.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    )
    return ["otlp"] if endpoint else ["otlp_json_file"]


def _check_protocol(signal: str, environ: Mapping[str, str]) -> None:
    protocol = (
        environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol != "http/protobuf":
        raise TelemetryError(
            f"OTLP protocol {protocol!r} is not supported here; use http/protobuf "
            "(OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, usually port 4318)"
        )


def _exporter(signal: str, name: str, path: Path, environ: Mapping[str, str], rotation: Rotation) -> Any:
    """One exporter by its standard name; `signal` is "traces" or "metrics"."""
    if name == "otlp":
        _check_protocol(signal, environ)
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    if name == "otlp_json_file":
        path.parent.mkdir(parents=True, exist_ok=True)
        prune_departed(path.parent, rotation.share())
        stream = RotatingLines(path, rotation)
        if signal == "traces":
            from opentelemetry.exporter.otlp.json.file.trace_exporter import FileSpanExporter

            return FileSpanExporter(stream=stream)
        from opentelemetry.exporter.otlp.json.file.metric_exporter import FileMetricExporter

        return FileMetricExporter(stream=stream)
    return _entry_point(signal, name).load()()


def _entry_point(signal: str, name: str) -> Any:
    """An installed exporter by its registered name (how the SDK's own auto-configuration finds them)."""
    if (signal, name) == ("metrics", "prometheus"):  # its reader would bind port 9464 in every process
        raise TelemetryError(
            "OTEL_METRICS_EXPORTER=prometheus is not used here: the gateway serves the whole pipeline's "
            "metrics in the Prometheus format at GET /metrics"
        )
    found = entry_points(group=f"opentelemetry_{signal}_exporter", name=name)
    if not found:
        raise TelemetryError(f"OTEL_{signal.upper()}_EXPORTER: no exporter named {name!r} is installed")
    return next(iter(found))


def exporters(
    signal: str,
    component: str,
    directory: Path,
    environ: Mapping[str, str],
    rotation: Rotation = DEFAULT_ROTATION,
) -> list[SpanExporter] | list[MetricExporter]:
    """The exporters the environment asks for. File exports are per process (pid in the
    name), so a restarted lane never appends to a line its killed predecessor cut short."""
    path = directory / f"{service_name(component, environ)}.{os.getpid()}.{signal}.jsonl"
    return [
        _exporter(signal, name, path, environ, rotation) for name in _names(signal, environ) if name != "none"
    ]


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Fail early (in the supervisor, before any lane starts) on settings no lane could honour."""
    for signal in ("traces", "metrics"):
        for name in _names(signal, environ):
            if name == "otlp":
                _check_protocol(signal, environ)
            elif name not in ("none", "otlp_json_file"):
                _entry_point(signal, name)


class Telemetry:
    """This process's tracer and meter, and the providers to flush at exit."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider) -> None:
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        self.tracer: Tracer = tracer_provider.get_tracer(SCOPE, __version__)
        self.meter: Meter = meter_provider.get_meter(SCOPE, __version__)

    @classmethod
    def configure(
        cls,
        component: str,
        directory: str | Path,
        run_id: str = "",
        environ: Mapping[str, str] | None = None,
        readers: Sequence[MetricReader] = (),
        rotation: Rotation = DEFAULT_ROTATION,
    ) -> Telemetry:
        """Providers and exporters as the OTEL_* environment asks (see the module docstring), plus
        `readers` of this process's own (the orchestrator's Prometheus exposition)."""
        environ = os.environ if environ is None else environ
        try:
            span_exporters = exporters("traces", component, Path(directory), environ, rotation)
            metric_exporters = exporters("metrics", component, Path(directory), environ, rotation)
        except TelemetryError as exc:  # `check` stops a bad setting at start; this is the safety net
            log.error("telemetry: %s; writing OTLP/JSON files instead", exc)
            files = "otlp_json_file"
            environ = {**environ, "OTEL_TRACES_EXPORTER": files, "OTEL_METRICS_EXPORTER": files}
            span_exporters = exporters("traces", component, Path(directory), environ, rotation)
            metric_exporters = exporters("metrics", component, Path(directory), environ, rotation)
        res = resource(component, run_id, environ)
        tracer_provider = TracerProvider(resource=res)
        queue = None if "OTEL_BSP_MAX_QUEUE_SIZE" in environ else DEFAULT_QUEUE
        for exporter in span_exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=queue))  # type: ignore[arg-type]
        interval = None if "OTEL_METRIC_EXPORT_INTERVAL" in environ else DEFAULT_METRIC_INTERVAL_MS
        periodic = [
            PeriodicExportingMetricReader(e, export_interval_millis=interval)  # type: ignore[arg-type]
            for e in metric_exporters
        ]
        return cls(tracer_provider, MeterProvider(resource=res, metric_readers=[*periodic, *readers]))

    def shutdown(self) -> None:
        """Flush and close every exporter; called once on the way out of the process."""
        for provider in (self.tracer_provider, self.meter_provider):
            try:
                provider.shutdown()
            except Exception:  # telemetry must never turn a clean exit into a crash
                log.exception("telemetry: flushing %s failed", type(provider).__name__)

    # --- spans ------------------------------------------------------------------------

    def start(
        self,
        name: str,
        parent: Mapping[str, str] | Span | None = None,
        attributes: Mapping[str, Any] | None = None,
        *,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        start_time: int | None = None,
    ) -> Span:
        """A span under `parent`: a W3C carrier from a message, a local span, or None for a new trace."""
        return self.tracer.start_span(
            name, context=parent_context(parent), kind=kind, attributes=attributes, start_time=start_time
        )

    @contextmanager
    def span(
        self,
        name: str,
        parent: Mapping[str, str] | Span | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Iterator[Span]:
        span = self.start(name, parent, attributes)
        try:
            yield span
        except BaseException as exc:
            fail(span, exc)
            raise
        finally:
            span.end()

    def fault(
        self,
        parent: Mapping[str, str] | Span | None,
        kind: str,
        lane: str,
        message: str,
        *,
        request_id: str | None = None,
        step: int | None = None,
    ) -> None:
        """A fault as a short span with error status and one `speclanes.fault` event, so a
        request that survives a fault keeps an OK root while its trace still shows it."""
        attrs: dict[str, Any] = {"speclanes.fault.kind": kind, "speclanes.lane": lane}
        if request_id:
            attrs["speclanes.request_id"] = request_id
        if step is not None:
            attrs["speclanes.step"] = step
        span = self.start(f"fault {kind}", parent, attrs)
        span.add_event("speclanes.fault", {**attrs, "speclanes.fault.message": message})
        span.set_status(Status(StatusCode.ERROR, f"{kind} on {lane}: {message}"))
        span.end()


def parent_context(parent: Mapping[str, str] | Span | None) -> otel_context.Context | None:
    if parent is None:
        return None
    if isinstance(parent, Span):
        return trace.set_span_in_context(parent)
    return PROPAGATOR.extract(parent) if parent else None


def carrier(span: Span) -> dict[str, str]:
    """The W3C trace context of `span`, for a message's `trace` field."""
    out: dict[str, str] = {}
    PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
    return out


def with_baggage(trace_context: Mapping[str, str], key: str, value: str) -> dict[str, str]:
    """A W3C carrier with one W3C baggage entry added (the `baggage` header's format)."""
    out = dict(trace_context)
    BAGGAGE.inject(out, context=baggage.set_baggage(key, value))
    return out


def baggage_of(trace_context: Mapping[str, str], key: str) -> str | None:
    value = baggage.get_baggage(key, BAGGAGE.extract(trace_context))
    return None if value is None else str(value)


def fail(span: Span, error: BaseException | str) -> None:
    if isinstance(error, BaseException):
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))
