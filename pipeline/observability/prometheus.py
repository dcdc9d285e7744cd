"""The Prometheus text format of one process's OpenTelemetry metrics, made on demand.

The orchestrator counts every step of every request (observability/metrics.py), so its instruments
are the pipeline's numbers; it adds this reader to its meter provider next to the OTLP exporters
and answers a `MetricsQuery` with the text, which the gateway serves as `GET /metrics`. The text is
made by the OpenTelemetry Prometheus exporter and prometheus_client, never by hand: the names follow
the OpenTelemetry-to-Prometheus rules (`speclanes.step.duration` in seconds becomes
`speclanes_step_duration_seconds`, counters end in `_total`). A private registry, not the process's
global one, so several pipelines' cores can live in one test process.
"""

from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST  # text/plain; version=0.0.4


class PrometheusExposition:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # The resource (service, run id, host) is one `target_info` series, not labels on every series.
        self.reader = PrometheusMetricReader(registry=self.registry)

    def text(self) -> str:
        """Collects now: the observable instruments' callbacks run in the calling thread."""
        return generate_latest(self.registry).decode()
