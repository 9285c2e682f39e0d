"""deploy/grafana: the dashboards are tidy Grafana JSON, every PromQL expression in them (and in the alert
rules) is accepted by Prometheus' own parser, every metric they name is one the gateway (or, for the
engines' own `vllm:*` / `sglang:*` names, a simulated engine) exposes, and the engine panels show data
when a real Prometheus scrapes vLLM and SGLang simulators as the PodMonitor of deploy/kubernetes does."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.prometheus_support import (
    ALERTS,
    DASHBOARDS,
    DEPLOY,
    PROMETHEUS,
    Query,
    RunningPrometheus,
    dashboard_queries,
    engine_names,
    exposed_families,
    gateway_names,
    podmonitor_scrape_config,
    rule_queries,
    series_names,
    substitute,
)
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

# Metrics being added to gateway/observability/metrics.py that dashboards or alerts already use, `{family: type}`;
# once /metrics exposes one, its type is checked against this. Remove an entry when it has landed, so
# that a later rename breaks test_every_metric_name_is_exposed. Empty: issue 6's additions (TPOT,
# retries, ejected/draining/redis_up gauges, image fetches) landed in commit 4536649.
PENDING_FAMILIES: dict[str, str] = {}


def all_queries() -> list[Query]:
    return [query for path in DASHBOARDS for query in dashboard_queries(path)] + rule_queries()


def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk(panel.get("panels", []))


@pytest.fixture
def exposition(start_sim: Callable[..., RunningSim], start_gateway: Callable[..., RunningGateway]) -> str:
    """The /metrics text of a running gateway in front of one simulated worker, with Redis (so the
    Redis series exist; no request is sent, so no affinity key is written)."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], redis_url=shared_redis_url(),
                       affinity={"key_prefix": "kimi-test-dashboards"})
    return httpx.get(gw.url + "/metrics").text


def test_both_dashboards_exist() -> None:
    assert {path.name for path in DASHBOARDS} == {"kimi-gateway-overview.json", "kimi-gateway-workers.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_tidy(path: Path) -> None:
    board = json.loads(path.read_text())
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["pool"]["type"] == "query"
    assert variables["pool"]["multi"] and variables["pool"]["includeAll"] and variables["pool"]["allValue"] == ".*"

    panels = list(walk(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]
            substitute(target["expr"])  # only variables the test knows


def test_variables_are_substituted_everywhere() -> None:
    for query in all_queries():
        assert "$" not in query.expr.replace('"$1"', ""), query


def test_provisioning_files() -> None:
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kimi-gateway.yml").read_text())
    assert providers["apiVersion"] == 1
    assert providers["providers"][0]["type"] == "file" and providers["providers"][0]["options"]["path"]


@pytest.mark.skipif(not PROMETHEUS.exists(), reason="prometheus not installed (Debian package prometheus)")
def test_every_expression_parses(tmp_path: Path, unused_port: int) -> None:
    """Each expression goes through the running server's /api/v1/format_query: Prometheus' own parser,
    which answers 400 `bad_data` for an expression it cannot parse."""
    prometheus = RunningPrometheus({"global": {"scrape_interval": "15s"}}, tmp_path, unused_port).start()
    try:
        broken = prometheus.api("format_query", query='sum(rate(kimi_gateway_requests_total{pool=~".*"}[1m])')
        assert (broken.status_code, broken.json()["errorType"]) == (400, "bad_data")  # the check can fail

        failures = []
        queries = all_queries()
        for query in queries:
            response = prometheus.api("format_query", query=query.expr)
            if response.status_code != 200:
                failures.append(f"{query.where}: {response.json().get('error')}")
        assert not failures, "\n".join(failures)
        assert len(queries) > 60
    finally:
        prometheus.stop()


def test_every_metric_name_is_exposed(exposition: str) -> None:
    families = exposed_families(exposition)
    for name, kind in PENDING_FAMILIES.items():
        assert families.get(name, kind) == kind, f"{name} is exposed as a {families[name]}, not a {kind}"
    known = series_names(families) | series_names(PENDING_FAMILIES)
    assert "kimi_gateway_requests_total" in known and "kimi_gateway_ttft_seconds_bucket" in known

    unknown = [f"{query.where}: {name}" for query in all_queries() for name in sorted(gateway_names(query.expr))
               if name not in known]
    assert not unknown, "metrics the gateway does not expose:\n" + "\n".join(unknown)
    used = {name for query in all_queries() for name in gateway_names(query.expr)}
    assert len(used) >= 20


def test_a_renamed_metric_is_caught(exposition: str) -> None:
    """The name check fails for a name the gateway does not expose."""
    known = series_names(exposed_families(exposition)) | series_names(PENDING_FAMILIES)
    assert gateway_names('sum(rate(kimi_gateway_request_total{pool="a"}[1m]))') - known == {
        "kimi_gateway_request_total"}


# The workers dashboard's row of the engines' own metrics (scraped by the PodMonitor, labelled `pool`).
WORKERS = DEPLOY / "grafana" / "dashboards" / "kimi-gateway-workers.json"
ENGINE_PANELS = {"Engine queue by pool", "Engine running by pool", "Engine KV-cache usage by pool",
                 "Engine prefix-cache hit rate by pool"}
# Pool -> (engine, sim api_version): vLLM 0.9 and later, vLLM before 0.9 (vllm:gpu_cache_usage_perc...), SGLang.
ENGINE_POOLS = {"vllm-128k": ("vllm", "current"), "vllm-old": ("vllm", "legacy"), "sglang-512k": ("sglang", "current")}
PROMPT = " ".join(f"Paragraph {k}: a long shared system prompt, cached by the engine after its first use."
                  for k in range(60))


@pytest.fixture
def engine_sims(start_sim: Callable[..., RunningSim]) -> dict[str, RunningSim]:
    """One simulated engine per pool of ENGINE_POOLS, each with a prefix cache."""
    return {name: start_sim(engine, api_version=version, kv_capacity_tokens=100_000)
            for name, (engine, version) in ENGINE_POOLS.items()}


def test_every_engine_metric_name_is_exposed(engine_sims: dict[str, RunningSim]) -> None:
    """Every `vllm:*` / `sglang:*` series the dashboards and alerts select is one a simulated engine
    (vLLM current or legacy, SGLang) exposes, as the engines name them (sources in gateway/sim/dialects.py)."""
    known: set[str] = set()
    for sim in engine_sims.values():
        known |= series_names(exposed_families(httpx.get(sim.url + "/metrics").text))
    used = {name for query in all_queries() for name in engine_names(query.expr)}
    assert {"vllm:num_requests_waiting", "sglang:num_queue_reqs", "vllm:gpu_cache_usage_perc"} <= used
    assert sorted(used - known) == [], "engine metrics no simulated engine exposes"
    assert engine_names("sum(vllm:num_request_waiting)") - known == {"vllm:num_request_waiting"}  # can fail


@pytest.mark.skipif(not PROMETHEUS.exists(), reason="prometheus not installed (Debian package prometheus)")
def test_engine_panels_show_what_prometheus_scrapes_from_the_engines(engine_sims: dict[str, RunningSim],
                                                                     tmp_path: Path, unused_port: int) -> None:
    """A real Prometheus scrapes the three simulated engines with the PodMonitor's relabelings (a
    LeaderWorkerSet follower, worker-index 1, is dropped before it is scraped); after the same long
    prompt went twice to each engine, every query of the engine panels has data for the pools of
    its engine (vLLM queries for both vLLM generations), and the prefix-cache hit rate is over 0.
    The engine recording rules of alerts.yml cover all three pools, and no alert fires."""
    board = json.loads(WORKERS.read_text())
    panels = {p["title"]: p for p in walk(board["panels"])}
    assert set(panels) >= ENGINE_PANELS, sorted(ENGINE_PANELS - set(panels))

    pods = {sim.url.removeprefix("http://"): {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "engine",
                                              "app.kubernetes.io/instance": f"{name}-0"}
            for name, sim in engine_sims.items()}
    pods[engine_sims["sglang-512k"].url.removeprefix("http://")]["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
    pods["127.0.0.1:9"] = {"app.kubernetes.io/name": "sglang-512k", "app.kubernetes.io/instance": "sglang-512k-0",
                           "leaderworkerset.sigs.k8s.io/worker-index": "1"}  # serves nothing: must not be a target
    config = {"global": {"scrape_interval": "500ms", "scrape_timeout": "400ms", "evaluation_interval": "1s"},
              "rule_files": [str(ALERTS)], "scrape_configs": [podmonitor_scrape_config(pods)]}
    prometheus = RunningPrometheus(config, tmp_path, unused_port).start()
    try:
        up = 'count(up{job="kimi-k3-engine"} == 1)'
        prometheus.wait_for(up, lambda v: v == len(ENGINE_POOLS))
        assert prometheus.value('count(up{job="kimi-k3-engine"})') == len(ENGINE_POOLS)  # the follower is dropped
        for name, sim in engine_sims.items():
            client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
            for _ in range(2):
                client.chat.completions.create(model="kimi-k3", max_tokens=4,
                                               messages=[{"role": "user", "content": PROMPT}])
            labels = prometheus.query(f'vllm:num_requests_running{{pool="{name}"}}'
                                      f' or sglang:num_running_reqs{{pool="{name}"}}')
            assert [r["metric"]["engine_instance"] for r in labels] == [f"{name}-0"]

        expected = {"vllm": {n for n, (e, _) in ENGINE_POOLS.items() if e == "vllm"},
                    "sglang": {n for n, (e, _) in ENGINE_POOLS.items() if e == "sglang"}}
        deadline = time.monotonic() + 20
        for title in sorted(ENGINE_PANELS):
            for target in panels[title]["targets"]:
                expr = substitute(target["expr"])
                (engine,) = {name.split(":")[0] for name in engine_names(expr)}
                while True:
                    result = prometheus.query(expr)
                    values = {r["metric"]["pool"]: float(r["value"][1]) for r in result}
                    settled = set(values) == expected[engine] and all(math.isfinite(v) for v in values.values())
                    if settled and ("hit rate" not in title or min(values.values()) > 0):
                        break
                    assert time.monotonic() < deadline, f"{title} [{target['refId']}]: {values} for {expr}"
                    time.sleep(0.2)
                if title.endswith(("KV-cache usage by pool", "hit rate by pool")):  # fractions
                    assert all(0 <= v <= 1 for v in values.values()), f"{title}: {values}"

        # The engine recording rules see every pool under either engine's names; no engine alert fires.
        for record in ("pool:kimi_engine_requests_waiting:sum", "pool:kimi_engine_requests_running:sum",
                       "pool:kimi_engine_kv_cache_usage:max"):
            prometheus.wait_for(f"count({record})", lambda v: v == len(ENGINE_POOLS))
            assert {r["metric"]["pool"] for r in prometheus.query(record)} == set(ENGINE_POOLS), record
        groups = prometheus.api("rules").json()["data"]["groups"]
        (engine_group,) = [g for g in groups if g["name"] == "kimi-k3-engines"]
        assert [r["lastError"] for r in engine_group["rules"] if r["health"] != "ok"] == []
        assert prometheus.api("alerts").json()["data"]["alerts"] == []
    finally:
        prometheus.stop()
