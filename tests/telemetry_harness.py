"""Telemetry that keeps every finished span in memory, for tests of what the code traces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.observability.telemetry import Telemetry
from pipeline.workers.step_spans import PREFIX


class MemoryTelemetry(Telemetry):
    def __init__(self, readers: Sequence[MetricReader] = ()) -> None:
        """`readers`: more metric readers (a Prometheus exposition), beside the in-memory one."""
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        super().__init__(tracer_provider, MeterProvider(metric_readers=[self.reader, *readers]))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


def steps_of(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A run span's steps (`workers.step_spans`), one dict each (`{"number": 3, "k": 4, ...}`), from
    its columns: an SDK span's tuples, or the lists of an exported one."""
    columns = {k.removeprefix(PREFIX): v for k, v in attributes.items() if k.startswith(PREFIX)}
    count = len(columns.get("number", ()))
    return [{key: column[i] for key, column in columns.items()} for i in range(count)]
