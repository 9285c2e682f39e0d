"""The status page's data: StatusWindow deltas over real collectors, and a worker's one-word state."""

from __future__ import annotations

from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import StatusWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def traffic(metrics: GatewayMetrics, pool: str, ok: int, errors: int = 0, hits: int = 0, misses: int = 0) -> None:
    metrics.requests.labels("chat", pool, "2xx", "kimi-k3").inc(ok)
    if errors:
        metrics.requests.labels("chat", pool, "5xx", "kimi-k3").inc(errors)
    metrics.route_decisions.labels(pool, "affinity").inc(hits)
    metrics.route_decisions.labels(pool, "no_match").inc(ok + errors - hits)
    metrics.affinity_lookups.labels(pool, "hit").inc(hits)
    metrics.affinity_lookups.labels(pool, "miss").inc(misses)


def test_first_call_reports_everything_since_start() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    window = StatusWindow(metrics, window_s=30, clock=clock)
    traffic(metrics, "a", ok=8, errors=2, hits=3, misses=7)
    metrics.ttft_seconds.labels("a", "kimi-k3").observe(0.2)
    metrics.ttft_seconds.labels("a", "kimi-k3").observe(0.4)
    metrics.requests.labels("chat", "none", "4xx", "none").inc(5)  # refused before a pool was chosen
    clock.now += 10
    recent = window.recent(["a", "b"])
    assert recent["span_s"] == 10
    a = recent["pools"]["a"]
    assert (a["requests"], a["requests_per_s"], a["errors"], a["error_ratio"]) == (10, 1.0, 2, 0.2)
    assert a["status"] == {"2xx": 8, "5xx": 2}
    assert a["decisions"] == {"affinity": 3, "no_match": 7}
    assert (a["affinity"], a["affinity_hit_ratio"]) == ({"hit": 3, "miss": 7}, 0.3)
    assert abs(a["ttft_mean_s"] - 0.3) < 1e-9
    b = recent["pools"]["b"]  # configured, no traffic: zeros and no ratios
    assert (b["requests"], b["requests_per_s"], b["error_ratio"], b["affinity_hit_ratio"], b["ttft_mean_s"]) == (
        0, 0.0, None, None, None)
    assert recent["total"]["requests"] == 15 and recent["total"]["status"] == {"2xx": 8, "5xx": 2, "4xx": 5}


def test_old_traffic_leaves_the_window() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    window = StatusWindow(metrics, window_s=30, min_spacing_s=1, clock=clock)
    traffic(metrics, "a", ok=100)
    for _ in range(20):  # the page polls every 2 s for 40 s; the burst was before the first poll
        clock.now += 2
        window.recent(["a"])
    traffic(metrics, "a", ok=6, hits=6, misses=0)
    clock.now += 2
    recent = window.recent(["a"])
    assert recent["span_s"] == 30  # the baseline is the newest sample at least 30 s old
    a = recent["pools"]["a"]
    assert a["requests"] == 6 and a["requests_per_s"] == 0.2 and a["affinity_hit_ratio"] == 1.0
    assert len(window.samples) <= 30 / 1 + 2


def test_polls_closer_than_min_spacing_keep_no_extra_samples() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    window = StatusWindow(metrics, window_s=30, min_spacing_s=1, clock=clock)
    for _ in range(100):  # ten dashboards polling at once
        clock.now += 0.01
        window.recent(["a"])
    assert len(window.samples) == 1
    clock.now += 1
    window.recent(["a"])
    assert len(window.samples) == 2


def test_worker_state_precedence_and_readiness() -> None:
    clock = Clock()
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 1000,
                                      "workers": ["http://a:1", "http://b:1"]}]}, environ={})
    metrics = GatewayMetrics()
    reg = WorkerRegistry(config, metrics, clock=clock)
    a, b = reg.pools["p"]
    assert reg.find("p", 1) is b and reg.find("p", 2) is None and reg.find("q", 0) is None
    assert metrics.registry.get_sample_value("kimi_gateway_worker_draining", {"pool": "p", "worker": "p/0"}) == 0
    reg.set_draining(a, True)
    assert a.state(clock.now) == "draining" and [w.index for w in reg.candidates("p")] == [1]
    assert metrics.registry.get_sample_value("kimi_gateway_worker_draining", {"pool": "p", "worker": "p/0"}) == 1
    a.ejected_until = clock.now + 5
    assert a.state(clock.now) == "ejected"
    reg.connect_failed(a, "refused")
    assert a.state(clock.now) == "unhealthy" and a.draining
    reg.set_draining(b, True)
    assert reg.candidates("p") == [] and reg.unready_pools() == ["p"]
    reg.set_draining(b, False)
    assert b.state(clock.now) == "healthy" and reg.unready_pools() == []
