"""Admin API against real simulated engines: list, drain / undrain (no new requests, in-flight
streams finish), 404 for unknown workers, auth (401 / 403 / 200), the draining gauge, /ready,
and the status summary the dashboard polls."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.auth.keys import hash_key
from tests.support import GatewayProcess, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
USER_KEY = "sk-user-" + uuid.uuid4().hex + uuid.uuid4().hex
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex + uuid.uuid4().hex
DRAIN_KEY = "sk-drain-" + uuid.uuid4().hex + uuid.uuid4().hex


def send(gw: RunningGateway, **headers: str) -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", json=CHAT, headers=headers, timeout=10)


def wait_until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll `check` every 50 ms until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
    return result


def draining_gauge(gw: RunningGateway, worker: str) -> float:
    pool_name = worker.split("/")[0]
    return gw.metric(f'kimi_gateway_worker_draining{{pool="{pool_name}",worker="{worker}"}}')


def test_list_shows_every_pool_and_worker_with_state(start_sim: StartSim, start_gateway: StartGateway) -> None:
    a, b, c = start_sim("vllm"), start_sim("vllm"), start_sim("sglang", max_context_tokens=524288)
    gw = start_gateway([pool("short", "vllm", [a.url, b.url], 131072, policy="round_robin"),
                        pool("long", "sglang", [c.url], 524288)])

    def scraped() -> dict[str, Any] | None:
        body = httpx.get(gw.url + "/admin/workers").json()
        workers = [w for p in body["pools"] for w in p["workers"]]
        return body if all(w["engine_running"] is not None for w in workers) else None

    body = wait_until(scraped)  # the load scraper has read every engine's /metrics once
    assert [(p["name"], p["engine"], p["max_context_tokens"], p["ready"]) for p in body["pools"]] == [
        ("short", "vllm", 131072, True), ("long", "sglang", 524288, True)]
    workers = {w["id"]: w for p in body["pools"] for w in p["workers"]}
    assert {i: w["url"] for i, w in workers.items()} == {"short/0": a.url, "short/1": b.url, "long/0": c.url}
    for w in workers.values():
        assert (w["state"], w["healthy"], w["draining"], w["ejected"], w["in_flight"]) == (
            "healthy", True, False, False, 0)
        assert w["engine_waiting"] == 0 and 0.0 <= w["kv_usage"] <= 1.0 and w["last_error"] is None
    one = httpx.get(gw.url + "/admin/workers/long/0").json()
    assert (one["id"], one["engine"], one["url"]) == ("long/0", "sglang", c.url)


def test_drained_worker_gets_no_new_requests_while_its_stream_finishes(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", tpot_s=0.03), start_sim("vllm", tpot_s=0.03)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")])
    admin = httpx.Client(base_url=gw.url, timeout=10)
    stream_body = {**CHAT, "stream": True, "max_tokens": 60}  # ~1.8 s of tokens
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=stream_body, timeout=30) as stream:
        assert stream.status_code == 200
        busy = stream.headers["x-kimi-gateway-worker"]
        index = int(busy.split("/")[1])
        drained, other = sims[index], sims[1 - index]
        assert draining_gauge(gw, busy) == 0

        answer = admin.post(f"/admin/workers/{busy}/drain")
        assert answer.status_code == 200
        assert (answer.json()["id"], answer.json()["state"], answer.json()["draining"]) == (busy, "draining", True)
        assert answer.json()["in_flight"] == 1  # the stream is still open on it
        assert draining_gauge(gw, busy) == 1
        assert admin.post(f"/admin/workers/{busy}/drain").json()["draining"] is True  # idempotent

        served_by_other = len(other.engine.records)
        for _ in range(6):
            assert send(gw).headers["x-kimi-gateway-worker"] == f"p/{1 - index}"
        assert len(drained.engine.records) == 1  # only the stream it was already serving
        assert len(other.engine.records) == served_by_other + 6

        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    record = drained.engine.records[0]
    assert record.completed and not record.aborted and record.completion_tokens_sent == 60

    answer = admin.post(f"/admin/workers/{busy}/undrain")
    assert (answer.json()["state"], answer.json()["draining"], answer.json()["in_flight"]) == ("healthy", False, 0)
    assert draining_gauge(gw, busy) == 0
    assert {send(gw).headers["x-kimi-gateway-worker"] for _ in range(4)} == {"p/0", "p/1"}
    assert len(drained.engine.records) >= 3


def test_pool_with_every_worker_drained_spills_over_and_is_named_unready(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    small, large = start_sim("vllm"), start_sim("sglang", max_context_tokens=524288)
    gw = start_gateway([pool("small", "vllm", [small.url], 131072), pool("large", "sglang", [large.url], 524288)])
    assert httpx.post(gw.url + "/admin/workers/small/0/drain").status_code == 200
    ready = httpx.get(gw.url + "/ready")  # the replica still routes (readiness.pools: any)
    assert ready.status_code == 200 and ready.json()["unready_pools"] == ["small"]
    assert send(gw).headers["x-kimi-gateway-pool"] == "large"
    assert small.engine.records == []
    status = httpx.get(gw.url + "/admin/status").json()
    assert status["ready"] is True
    assert [(p["name"], p["ready"]) for p in status["pools"]] == [("small", False), ("large", True)]

    assert httpx.post(gw.url + "/admin/workers/small/0/undrain").status_code == 200
    assert httpx.get(gw.url + "/ready").status_code == 200
    assert send(gw).headers["x-kimi-gateway-pool"] == "small"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/admin/workers/p/2/drain"), ("POST", "/admin/workers/nope/0/undrain"),
    ("GET", "/admin/workers/p/x"), ("POST", "/admin/workers/p/-1/drain"), ("GET", "/admin/workers/p/99")])
def test_unknown_worker_is_a_404_error_object(start_sim: StartSim, start_gateway: StartGateway,
                                              method: str, path: str) -> None:
    sims = [start_sim("vllm"), start_sim("vllm")]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)])
    answer = httpx.request(method, gw.url + path)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "worker_not_found" and error["type"] == "invalid_request_error"
    assert error["param"] is None and "p/0, p/1" in error["message"]
    assert all(not w["draining"] for w in httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"])


def test_admin_routes_need_the_admin_scope_when_auth_is_on(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth={"enabled": True, "keys": [
        {"name": "app", "sha256": hash_key(USER_KEY)},
        {"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["user", "admin"]}]})
    routes = [("GET", "/admin/workers"), ("GET", "/admin/workers/p/0"), ("GET", "/admin/status"),
              ("POST", "/admin/workers/p/0/drain"), ("POST", "/admin/workers/p/0/undrain")]
    for method, path in routes:
        missing = httpx.request(method, gw.url + path)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.request(method, gw.url + path, headers={"authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        user = httpx.request(method, gw.url + path, headers={"authorization": f"Bearer {USER_KEY}"})
        assert user.status_code == 403 and user.json()["error"]["code"] == "insufficient_permissions"
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert not httpx.get(gw.url + "/admin/workers/p/0", headers=admin).json()["draining"]  # refused drains did nothing
    assert send(gw, authorization=f"Bearer {USER_KEY}").status_code == 200  # the user key works on /v1

    ops = {"authorization": f"Bearer {ADMIN_KEY}"}
    for method, path in routes:
        assert httpx.request(method, gw.url + path, headers=ops).status_code == 200, path
    assert httpx.post(gw.url + "/admin/workers/p/9/drain", headers=ops).status_code == 404

    page = httpx.get(gw.url + "/dashboard")  # the HTML is public and carries no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert sim.url not in page.text and "p/0" not in page.text


def test_a_drain_key_may_only_list_drain_and_undrain_workers(start_sim: StartSim,
                                                            start_gateway: StartGateway) -> None:
    """The `drain` scope (an engine pod's key): the four routes `kimi-gateway drain` calls, nothing else."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth={"enabled": True, "keys": [
        {"name": "engine-drains", "sha256": hash_key(DRAIN_KEY), "scopes": ["drain"]}]})
    key = {"authorization": f"Bearer {DRAIN_KEY}"}
    assert httpx.get(gw.url + "/admin/workers", headers=key).status_code == 200
    assert httpx.post(gw.url + "/admin/workers/p/0/drain", headers=key).json()["draining"] is True
    assert httpx.get(gw.url + "/admin/workers/p/0", headers=key).json()["draining"] is True
    assert httpx.post(gw.url + "/admin/workers/p/0/undrain", headers=key).json()["draining"] is False
    for method, path in [("GET", "/admin/status"), ("POST", "/admin/reload")]:
        refused = httpx.request(method, gw.url + path, headers=key)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_permissions", path
    assert send(gw, authorization=f"Bearer {DRAIN_KEY}").status_code == 403  # no /v1 either


def test_dashboard_page_is_self_contained_with_a_strict_csp(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    page = httpx.get(gw.url + "/dashboard")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert "script-src 'sha256-" in csp and "style-src 'sha256-" in csp
    assert page.headers["x-frame-options"] == "DENY"
    text = page.text
    assert "<script src" not in text and "<link" not in text and "http://" not in text and "https://" not in text
    assert "admin/status" in text and "sessionStorage" in text


def test_status_summary_counts_recent_traffic_per_pool(start_sim: StartSim, start_gateway: StartGateway) -> None:
    ok, broken = start_sim("vllm"), start_sim("sglang", max_context_tokens=524288, faults={"fail_status": 500})
    gw = start_gateway([pool("ok", "vllm", [ok.url], 131072, policy="round_robin"),
                        pool("broken", "sglang", [broken.url], 524288, policy="round_robin")])
    for _ in range(5):
        assert send(gw).status_code == 200
    streamed = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert streamed.status_code == 200
    big = {**CHAT, "max_tokens": 200_000}  # only the 512K pool fits; its engine answers 500
    assert httpx.post(gw.v1 + "/chat/completions", json=big, timeout=10).status_code >= 500
    status = httpx.get(gw.url + "/admin/status").json()
    recent = status["recent"]
    assert recent["span_s"] > 0
    mine = recent["pools"]["ok"]
    assert mine["requests"] == 6 and mine["status"] == {"2xx": 6} and mine["error_ratio"] == 0.0
    assert mine["decisions"] == {"round_robin": 6} and mine["requests_per_s"] > 0
    assert mine["ttft_mean_s"] is not None and mine["ttft_mean_s"] > 0  # the one streamed request
    theirs = recent["pools"]["broken"]
    assert theirs["requests"] == 1 and theirs["errors"] == 1 and theirs["error_ratio"] == 1.0
    assert recent["total"]["requests"] == 7 and recent["total"]["errors"] == 1


def test_status_figures_cover_every_serving_process(start_sim: StartSim,
                                                    start_gateway_process: Callable[..., GatewayProcess]) -> None:
    sim = start_sim("vllm")
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)], processes=2)
    pids: set[int] = set()
    deadline = time.monotonic() + 20
    while len(pids) < 2:  # a fresh connection each: the kernel hands them to either process
        assert time.monotonic() < deadline, f"only {pids} answered:\n{gw.log_text()}"
        pids.add(httpx.get(gw.url + "/health", headers={"connection": "close"}).json()["pid"])
    for _ in range(10):
        answer = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"connection": "close"})
        assert answer.status_code == 200
    polled: set[int] = set()
    deadline = time.monotonic() + 20
    while polled != pids:  # whichever process answers the poll reports all 10 requests
        assert time.monotonic() < deadline, f"polled only {polled} of {pids}"
        with httpx.Client() as one_connection:
            polled.add(one_connection.get(gw.url + "/health").json()["pid"])
            recent = one_connection.get(gw.url + "/admin/status").json()["recent"]
        assert recent["pools"]["p"]["requests"] == 10 and recent["pools"]["p"]["status"] == {"2xx": 10}
        assert sum(recent["pools"]["p"]["decisions"].values()) == 10


def test_a_page_on_another_site_cannot_drain_workers(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Auth off: a cross-site form post (a CORS simple request, no preflight) is refused."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    forged = httpx.post(gw.url + "/admin/workers/p/0/drain", content=b"x",
                        headers={"origin": "https://evil.example", "content-type": "text/plain"})
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "cross_origin_refused"
    assert httpx.get(gw.url + "/admin/workers/p/0").json()["draining"] is False
    same_site = httpx.post(gw.url + "/admin/workers/p/0/drain", headers={"origin": gw.url})
    assert same_site.status_code == 200 and same_site.json()["draining"] is True  # the status page's own origin
    assert httpx.post(gw.url + "/admin/workers/p/0/undrain").status_code == 200  # curl sends no Origin


@pytest.mark.parametrize("origin", [
    "http://rebound.example:{port}",  # DNS rebinding: the attacker's name now resolves to the gateway
    "http://rebound.example",
    "https://127.0.0.1.evil.example:{port}",
    "null",  # a sandboxed frame or a file: page
])
def test_a_page_whose_host_header_matches_its_origin_still_cannot_drain(
        start_sim: StartSim, start_gateway: StartGateway, origin: str) -> None:
    """Auth off: the Origin is compared with the gateway's own addresses, not with `Host`, which a
    DNS-rebinding page sets to its own name."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], admin_origins=["https://gateway.example"])
    port = gw.server.port
    origin = origin.format(port=port)
    host = origin.split("://")[-1] if "://" in origin else f"127.0.0.1:{port}"
    forged = httpx.post(gw.url + "/admin/workers/p/0/drain", content=b"x",
                        headers={"origin": origin, "host": host, "content-type": "text/plain"})
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "cross_origin_refused"
    assert httpx.get(gw.url + "/admin/workers/p/0").json()["draining"] is False
    for own in (f"http://localhost:{port}", f"http://127.0.0.1:{port}", "https://gateway.example",
                "https://GATEWAY.example:443"):  # the listening address and the configured origin
        answer = httpx.post(gw.url + "/admin/workers/p/0/drain", headers={"origin": own, "host": "anything"})
        assert answer.status_code == 200, (own, answer.text)
