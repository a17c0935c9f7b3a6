"""OpenTelemetry tracing across JobManager -> ClusterManager -> driver, when enabled.

Off by default. ``--trace-export`` (or env ``DLSCHED_TRACE_EXPORT``) turns it on:

- ``otlp``: OTLP over gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the collector a
  service mesh or an operator runs; the standard OTEL_* variables apply);
- ``console``: spans as JSON on stderr;
- ``file:PATH``: spans as JSON lines appended to PATH (tests use this).

Enabling instruments grpc.aio globally with the OpenTelemetry gRPC
instrumentation: every server span continues the caller's trace (W3C
``traceparent`` in the metadata) and every outgoing call carries it on, so one
SubmitJob is one trace across the three processes. Health checks and
reflection are not traced. Spans carry method names and status codes, never
a request body, so no credential can reach an exporter.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, TextIO

log = logging.getLogger("dlsched.tracing")

_lock = threading.Lock()
_enabled = False


def setup(export: str | None, service: str) -> bool:
    """Enable tracing for this process as ``service``; False when ``export`` is off."""
    global _enabled
    export = export or os.environ.get("DLSCHED_TRACE_EXPORT") or ""
    if not export or export == "off":
        return False
    with _lock:
        if _enabled:
            return True
        try:
            from opentelemetry import trace
            from opentelemetry.instrumentation.grpc import (
                GrpcAioInstrumentorClient,
                GrpcAioInstrumentorServer,
                filters,
            )
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as e:
            raise SystemExit(f"--trace-export needs the tracing extra: pip install 'dlsched[tracing]' ({e})") from e

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if export == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif export == "console" or export.startswith("file:"):
            out: TextIO = sys.stderr if export == "console" else open(export[5:], "a", buffering=1)  # noqa: SIM115
            provider.add_span_processor(SimpleSpanProcessor(_json_lines(out)))
        else:
            raise ValueError(f"--trace-export: want otlp, console or file:PATH, got {export!r}")
        trace.set_tracer_provider(provider)
        untraced = filters.negate(filters.any_of(filters.health_check(),
                                                 filters.service_prefix("grpc.reflection")))
        GrpcAioInstrumentorServer(filter_=untraced).instrument()
        GrpcAioInstrumentorClient(filter_=untraced).instrument()
        _enabled = True
        log.info("tracing on (%s) as %s", export.split(":", 1)[0], service)
        return True


def _json_lines(out: TextIO) -> Any:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
