"""Optional OpenTelemetry traces: one span per request with `route`, `upstream` and `relay` children.

Off (and free) while `tracing.otlp_endpoint` is unset. When on, a share of requests
(`sample_ratio`, decided here whatever the client's sampled flag says) gets a `kimi_gateway.request`
span (in the trace of the client's W3C `traceparent` when it sent one; its `tracestate` is dropped):

- `route`: arrival → the first upstream attempt (parsing, estimation, pool and worker choice);
- `upstream` (one per attempt): the request to the engine until its first body byte or the
  failure; its context goes to the engine as `traceparent`, so an engine that traces (vLLM's
  `--otlp-traces-endpoint`) hangs its own spans below it;
- `relay`: the first byte → the end of the response.

Attributes use the gateway's bounded vocabulary (pool, worker, reason, outcome, status, tokens);
never prompt text or keys. Spans are exported in batches over OTLP/HTTP (protobuf) by the SDK's
BatchSpanProcessor (https://opentelemetry.io/docs/specs/otlp/).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gateway.config_base import ConfigError
from gateway.observability.record import RequestOutcome, RequestRecord
from gateway.process_params import TracingConfig

try:  # the `tracing` extra
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - depends on the install
    trace = None  # type: ignore[assignment]


class Tracing:
    """The tracer provider and exporter of one gateway process, built at start-up.

    Raises ConfigError when `otlp_endpoint` is set but the `tracing` extra is not installed.
    """

    def __init__(self, config: TracingConfig) -> None:
        if trace is None:
            raise ConfigError("tracing.otlp_endpoint is set but OpenTelemetry is not installed: "
                              "pip install 'kimi-gateway[tracing]'")
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                                       sampler=TraceIdRatioBased(config.sample_ratio))
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=int(config.export_delay * 1000)))
        self.tracer = self.provider.get_tracer("kimi-gateway")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, record: RequestRecord, headers: Mapping[str, str]) -> RequestTrace:
        """Start the request span (its start is `record.started`), under the client's `traceparent`.

        Only its trace and parent span ids are taken: whether the request is traced is this
        gateway's sampler's decision (`sample_ratio`, by trace id), not the client's sampled flag,
        and the client's `tracestate` (vendor data) is not passed on to the engines."""
        traceparent = headers.get("traceparent")
        return RequestTrace(self, record, self.propagator.extract({"traceparent": traceparent} if traceparent else {}))

    def shutdown(self) -> None:
        """Export what is buffered, then stop (at the end of the lifespan)."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request; see the module docstring. Touched only on the event loop."""

    __slots__ = ("_attempt", "_first_attempt_ns", "_origin", "_root", "_tracing")

    def __init__(self, tracing: Tracing, record: RequestRecord, parent: Any) -> None:
        self._tracing = tracing
        # perf_counter seconds (the record's clock) -> wall-clock ns (OpenTelemetry's)
        self._origin = time.time_ns() - int(time.perf_counter() * 1e9)
        self._root = tracing.tracer.start_span(f"kimi_gateway.{record.api}", context=parent, kind=SpanKind.SERVER,
                                               start_time=self._ns(record.started),
                                               attributes={"kimi_gateway.request_id": record.request_id})
        self._attempt: Any = None
        self._first_attempt_ns: int | None = None

    def _ns(self, perf_seconds: float) -> int:
        return self._origin + int(perf_seconds * 1e9)

    def start_attempt(self, pool: str, worker: str) -> dict[str, str]:
        """Open an `upstream` span; returns the `traceparent` header(s) for the engine request."""
        self.end_attempt("abandoned")
        context = trace.set_span_in_context(self._root)
        self._attempt = self._tracing.tracer.start_span(
            "upstream", context=context, kind=SpanKind.CLIENT,
            attributes={"kimi_gateway.pool": pool, "kimi_gateway.worker": worker})
        if self._first_attempt_ns is None:
            self._first_attempt_ns = time.time_ns()
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=trace.set_span_in_context(self._attempt))
        return carrier

    def end_attempt(self, outcome: str) -> None:
        """Close the open `upstream` span with its outcome (`ok` or an `Outcome` value)."""
        if self._attempt is None:
            return
        self._attempt.set_attribute("kimi_gateway.outcome", outcome)
        if outcome != "ok":
            self._attempt.set_status(Status(StatusCode.ERROR, outcome))
        self._attempt.end()
        self._attempt = None

    def finish(self, record: RequestRecord, status: int, ended: float) -> None:
        """Add the `route` and `relay` spans from the record's times and end the request span."""
        self.end_attempt("abandoned" if record.outcome is RequestOutcome.OK else record.outcome)
        tracer, context = self._tracing.tracer, trace.set_span_in_context(self._root)
        end_ns = self._ns(ended)
        route_end = self._first_attempt_ns or end_ns
        tracer.start_span("route", context=context, start_time=self._ns(record.started)).end(end_time=route_end)
        if record.first_byte_at is not None:
            tracer.start_span("relay", context=context, start_time=self._ns(record.first_byte_at)).end(end_time=end_ns)
        root = self._root
        root.set_attributes({key: value for key, value in {
            "kimi_gateway.pool": record.pool, "kimi_gateway.worker": record.worker,
            "kimi_gateway.reason": record.reason, "kimi_gateway.attempts": record.attempts,
            "kimi_gateway.outcome": record.outcome, "kimi_gateway.stream": record.stream,
            "kimi_gateway.estimated_prompt_tokens": record.estimated_prompt_tokens,
            "http.response.status_code": status,
            "gen_ai.usage.input_tokens": (record.usage or {}).get("prompt_tokens"),
            "gen_ai.usage.output_tokens": (record.usage or {}).get("completion_tokens"),
        }.items() if value is not None})
        if record.migration is not None:  # a stream continued on another worker (dispatch/migration.py)
            root.set_attributes({f"kimi_gateway.migration.{key}": value for key, value in record.migration.items()
                                 if isinstance(value, (str, int))})
        if status >= 500 or record.outcome in (RequestOutcome.UPSTREAM_ERROR, RequestOutcome.TIMEOUT):
            root.set_status(Status(StatusCode.ERROR, record.error or record.outcome))
        root.end(end_time=end_ns)
