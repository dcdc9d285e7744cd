"""Observability: OpenTelemetry per process (`telemetry`: exporters from OTEL_*, spans, fault
spans), the orchestrator's metric instruments (`metrics`), and reading the OTLP/JSON file
export back for `speclanes trace` (`trace_files`)."""
