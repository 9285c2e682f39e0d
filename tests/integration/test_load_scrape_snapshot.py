"""A load scrape's snapshot of this replica's in-flight count is taken when the scrape is sent,
as the engine counts its requests when it answers: requests that finish while a slow `/metrics`
answer is read are not counted as still queued (issue 27 §2). A real HTTP server on loopback
answers `/metrics` in vLLM's exposition (vllm/v1/metrics/loggers.py: `vllm:num_requests_running`,
`vllm:num_requests_waiting`), computing it on arrival and sending it late."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.backends.h1 import H1Pool
from gateway.backends.load import LoadScraper
from gateway.backends.params import LoadConfig
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.serving.server import ThreadedServer


def slow_metrics_app(on_counted: Any) -> Any:
    """An ASGI engine whose `/metrics` counts 3 running requests, calls `on_counted()` (the three
    finish), then sends the answer 0.3 s later."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = (b'vllm:num_requests_running{model_name="kimi-k3"} 3.0\n'
                b'vllm:num_requests_waiting{model_name="kimi-k3"} 0.0\n')
        on_counted()
        await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.anyio
async def test_requests_finishing_during_a_slow_scrape_are_not_counted_as_queued() -> None:
    registry: WorkerRegistry | None = None

    def finished() -> None:  # on the server's thread: the engine counted them, then they ended
        assert registry is not None
        registry.pools["p"][0].in_flight = 0

    with ThreadedServer(slow_metrics_app(finished)) as server:
        config = parse_config({"pools": [{"name": "p", "engine": "vllm", "workers": [server.url],
                                          "max_context_tokens": 131072}]})
        registry = WorkerRegistry(config)
        worker = registry.pools["p"][0]
        worker.in_flight = 3  # this replica's three requests, on the engine when the scrape is sent
        client = H1Pool(5.0)
        try:
            scraper = LoadScraper(registry, client, LoadConfig(timeout=5.0), GatewayMetrics(), config.pools)
            assert await scraper.scrape(worker)
        finally:
            client.close()
    assert (worker.engine_running, worker.in_flight_at_scrape) == (3.0, 3)
    assert worker.load() == 0.0  # 3 counted by the engine, all 3 finished since: nothing queued
