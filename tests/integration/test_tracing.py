"""OpenTelemetry traces (gateway/observability/tracing.py), exported over OTLP/HTTP to a real loopback receiver."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.serving.server import ThreadedServer
from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector:
    """An OTLP/HTTP traces endpoint (protobuf) that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

        async def receive(request: Request) -> Response:
            export = ExportTraceServiceRequest()
            export.ParseFromString(await request.body())
            for resource in export.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            return Response(b"", media_type="application/x-protobuf")

        self.server = ThreadedServer(Starlette(routes=[Route("/v1/traces", receive, methods=["POST"])])).start()

    def wait_for(self, names: list[str], timeout: float = 10.0) -> dict[str, list[Any]]:
        deadline = time.monotonic() + timeout
        while True:
            by_name: dict[str, list[Any]] = {}
            for span in self.spans:
                by_name.setdefault(span.name, []).append(span)
            if all(name in by_name for name in names):
                return by_name
            assert time.monotonic() < deadline, f"spans seen: {sorted(by_name)}"
            time.sleep(0.05)


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.stop()


def _attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_a_request_with_a_retry_is_one_trace_under_the_clients_span(
        start_sim: StartSim, start_gateway: StartGateway, collector: Collector) -> None:
    failing = start_sim("vllm", faults=SimFaults(fail_status=500, fail_count=1))
    healthy = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [failing.url, healthy.url], 131072, policy="round_robin")],
                       tracing={"otlp_endpoint": collector.server.url + "/v1/traces", "export_delay": 0.1})
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "secret prompt"}], "max_tokens": 3,
            "stream": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=headers) as response:
        assert b"[DONE]" in b"".join(response.iter_raw())

    spans = collector.wait_for(["kimi_gateway.chat", "route", "upstream", "relay"])
    (root,) = spans["kimi_gateway.chat"]
    assert root.trace_id.hex() == CLIENT_TRACE and root.parent_span_id.hex() == CLIENT_SPAN
    attributes = _attributes(root)
    assert attributes["kimi_gateway.pool"] == "p" and attributes["kimi_gateway.attempts"] == 2
    assert attributes["kimi_gateway.worker"] == "p/1" and attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["http.response.status_code"] == 200
    children = [s for name in ("route", "upstream", "relay") for s in spans[name]]
    assert {s.parent_span_id for s in children} == {root.span_id}
    assert all(s.trace_id == root.trace_id for s in children)
    assert root.start_time_unix_nano <= spans["route"][0].start_time_unix_nano
    assert spans["relay"][0].end_time_unix_nano <= root.end_time_unix_nano

    attempts = sorted(spans["upstream"], key=lambda s: s.start_time_unix_nano)
    assert [_attributes(s)["kimi_gateway.outcome"] for s in attempts] == ["status_5xx", "ok"]
    assert [_attributes(s)["kimi_gateway.worker"] for s in attempts] == ["p/0", "p/1"]
    # Each engine was handed its attempt's span as the parent of whatever it traces.
    for sim, span in ((failing, attempts[0]), (healthy, attempts[1])):
        sent = sim.engine.records[-1].headers["traceparent"]
        assert sent == f"00-{CLIENT_TRACE}-{span.span_id.hex()}-01"
    everything = b"".join(s.SerializeToString() for s in collector.spans)
    assert b"secret prompt" not in everything  # no prompt text in traces


def test_tracing_off_sends_no_traceparent(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    httpx.post(gw.v1 + "/chat/completions", json={"model": "kimi-k3", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert "traceparent" not in sim.engine.records[-1].headers


@pytest.mark.parametrize(("ratio", "client_flags", "traced"), [
    (0.0, "01", False),  # the client's sampled flag does not force a trace
    (1.0, "00", True),  # nor does its unsampled flag stop one
])
def test_the_gateways_sampler_decides_and_tracestate_is_not_passed_on(
        start_sim: StartSim, start_gateway: StartGateway, collector: Collector, ratio: float, client_flags: str,
        traced: bool) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       tracing={"otlp_endpoint": collector.server.url + "/v1/traces", "sample_ratio": ratio})
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{client_flags}", "tracestate": "vendor=secret-value"}
    response = httpx.post(gw.v1 + "/chat/completions", headers=headers, json={
        "model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    gw.server.app.state.gateway.tracing.provider.force_flush()  # exports what was sampled, now
    sent = sim.engine.records[-1].headers
    assert "tracestate" not in sent
    assert sent["traceparent"].startswith(f"00-{CLIENT_TRACE}-") and sent["traceparent"].endswith(
        "-01" if traced else "-00")
    assert bool(collector.spans) is traced
    everything = b"".join(s.SerializeToString() for s in collector.spans)
    assert b"secret-value" not in everything


def test_a_migrated_stream_is_one_trace_with_its_continuation(
        start_sim: StartSim, start_gateway: StartGateway, collector: Collector) -> None:
    broken = start_sim("vllm", faults=SimFaults(drop_after_chunks=4))
    healthy = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [broken.url, healthy.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0},
                       tracing={"otlp_endpoint": collector.server.url + "/v1/traces", "export_delay": 0.1})
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body) as response:
        assert b"[DONE]" in b"".join(response.iter_raw())
    spans = collector.wait_for(["kimi_gateway.chat", "upstream"])
    attributes = _attributes(spans["kimi_gateway.chat"][0])
    assert attributes["kimi_gateway.migration.from"] == "p/0" and attributes["kimi_gateway.migration.to"] == "p/1"
    assert attributes["kimi_gateway.migration.outcome"] == "migrated"
    assert attributes["kimi_gateway.migration.kept_tokens"] == 3
    attempts = sorted(spans["upstream"], key=lambda s: s.start_time_unix_nano)
    assert [_attributes(s)["kimi_gateway.worker"] for s in attempts] == ["p/0", "p/1"]
    assert healthy.engine.records[-1].headers["traceparent"].split("-")[2] == attempts[1].span_id.hex()
