"""The real Prometheus server scrapes a gateway every 0.5 s while streaming traffic with repeated prefixes
flows, and its HTTP API shows the key series existing and moving; the dashboards' queries and the alert
rules then run against that data without errors, and no alert fires for a healthy gateway."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.prometheus_support import (
    ALERTS,
    DASHBOARDS,
    PROMETHEUS,
    RunningPrometheus,
    dashboard_queries,
    rule_queries,
    rules,
)
from tests.support import RunningGateway, RunningSim, pool

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(),
                                reason="/usr/bin/prometheus not installed (Debian package prometheus)")

CONVERSATIONS = 4      # per phase; each is two streaming turns, the second repeating the first as its prefix
MAX_TOKENS = 8         # the simulator answers exactly this many completion tokens
SYSTEM = "You are Kimi, a careful assistant."  # short: conversations share no 512-byte block

# Panels that must show data after the traffic below (file name, panel title).
PANELS_WITH_DATA = {
    ("kimi-gateway-overview.json", "Requests/s by pool"),
    ("kimi-gateway-overview.json", "TTFT p50 / p95 / p99"),
    ("kimi-gateway-overview.json", "End-to-end latency p50 / p95 / p99"),
    ("kimi-gateway-overview.json", "Route decisions/s by reason"),
    ("kimi-gateway-overview.json", "Affinity hit ratio"),
    ("kimi-gateway-overview.json", "Matched-prefix ratio"),
    ("kimi-gateway-overview.json", "Tokens/s by kind"),
    ("kimi-gateway-workers.json", "Health"),
    ("kimi-gateway-workers.json", "KV-cache usage (engine)"),
    ("kimi-gateway-workers.json", "Successful attempts/s by worker"),
}


def stream(client: openai.OpenAI, messages: list[dict[str, str]]) -> str:
    """One streaming chat completion through the real SDK; the answer's text."""
    chunks = client.chat.completions.create(model="kimi-k3", messages=messages, stream=True,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, stream_options={"include_usage": True})
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def converse(client: openai.OpenAI, tag: str) -> None:
    """CONVERSATIONS two-turn chats; each first turn has its own ~7 KB (~2,000-token) user message, over
    the affinity policy's min_match_tokens, so every second turn is an affinity hit."""
    for i in range(CONVERSATIONS):
        user = " ".join(f"Conversation {tag}{i}, paragraph {k}: why prefix caches pay off." for k in range(120))
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        answer = stream(client, first)
        stream(client, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}])


@pytest.fixture
def gateway(start_sim: Callable[..., RunningSim], start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    sims = [start_sim("vllm", ttft_s=0.06, tpot_s=0.005, kv_capacity_tokens=200_000) for _ in range(2)]
    return start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity")],
                         load={"interval": 0.5})


@pytest.fixture
def prometheus(gateway: RunningGateway, tmp_path: Path, unused_port: int) -> Iterator[RunningPrometheus]:
    config = {
        "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "kimi-gateway",
                            "static_configs": [{"targets": [gateway.url.removeprefix("http://")]}]}],
    }
    server = RunningPrometheus(config, tmp_path, unused_port).start()
    yield server
    server.stop()


def test_prometheus_scrapes_the_gateway_while_traffic_flows(gateway: RunningGateway,
                                                            prometheus: RunningPrometheus) -> None:
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0)
    started = time.time()
    prometheus.wait_for('up{job="kimi-gateway"}', lambda v: v == 1)
    requests = 'sum(kimi_gateway_requests_total{pool="p", status_class="2xx"})'
    ttft_count = 'sum(kimi_gateway_ttft_seconds_count{pool="p"})'
    per_phase = 2 * CONVERSATIONS

    # Two phases: each count reaches exactly what was sent, once and then again.
    for phase, tag in enumerate("ab", start=1):
        converse(client, tag)
        prometheus.wait_for(requests, lambda v, n=phase * per_phase: v == n)
        prometheus.wait_for(ttft_count, lambda v, n=phase * per_phase: v == n)
    total = 2 * per_phase

    # Scrapes during the traffic saw the counter climb, never fall.
    response = prometheus.api("query_range", query=requests, start=str(started), end=str(time.time()), step="0.5")
    samples = [float(v) for _, v in response.json()["data"]["result"][0]["values"]]
    assert samples == sorted(samples) and samples[-1] <= total
    assert len(set(samples)) >= 3, samples

    hits = prometheus.value('sum(kimi_gateway_affinity_lookups_total{pool="p", result="hit"})')
    assert hits is not None and hits >= 2 * CONVERSATIONS  # every second turn
    assert prometheus.value('sum(kimi_gateway_affinity_lookups_total{pool="p"})') == total  # one lookup a request
    assert prometheus.value('sum(kimi_gateway_route_decisions_total{pool="p", reason="affinity"})') >= 2 * CONVERSATIONS
    assert prometheus.value('sum(kimi_gateway_tokens_total{pool="p", kind="completion"})') == total * MAX_TOKENS
    ttft_buckets = 'rate(kimi_gateway_ttft_seconds_bucket{pool="p"}[1m])'
    p50 = prometheus.value(f"histogram_quantile(0.5, sum by (le) ({ttft_buckets}))")
    assert p50 is not None and 0.05 <= p50 < 10  # the simulator's TTFT is 0.06 s
    assert prometheus.value('min(kimi_gateway_worker_healthy{pool="p"})') == 1
    assert prometheus.value('count(kimi_gateway_worker_healthy{pool="p"})') == 2
    assert prometheus.value('count(kimi_gateway_engine_load{pool="p", signal="kv_usage"})') == 2

    # Every dashboard query runs on this data; the panels the traffic feeds show something.
    for path in DASHBOARDS:
        for query in dashboard_queries(path):
            result = prometheus.query(query.expr)
            file, _, title = query.where.partition(": ")
            if (file, title.rsplit(" [", 1)[0]) in PANELS_WITH_DATA:
                assert result, f"{query.where} is empty: {query.expr}"

    # Without Redis configured there is no Redis to be down (else KimiGatewayRedisDown would fire).
    assert prometheus.query("kimi_gateway_redis_up") == [], "kimi_gateway_redis_up must be absent without Redis"

    # The alert rules load, evaluate without errors, and stay quiet for a healthy gateway.
    evaluated_after = time.time()
    deadline = time.monotonic() + 20
    while True:
        loaded = [rule for group in prometheus.api("rules").json()["data"]["groups"] for rule in group["rules"]]
        fresh = [r for r in loaded if r["lastEvaluation"] > time.strftime("%Y-%m-%dT%H:%M:%S",
                                                                            time.gmtime(evaluated_after + 1))]
        if len(fresh) == len(loaded):
            break
        assert time.monotonic() < deadline, "the rules were not evaluated again within 20 s"
        time.sleep(0.5)
    assert len(loaded) == len(rules()) == len(rule_queries())
    assert [r["lastError"] for r in loaded if r["health"] != "ok"] == []
    assert prometheus.api("alerts").json()["data"]["alerts"] == []
