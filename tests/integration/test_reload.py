"""Reloading the config without downtime (gateway/serving/reload.py): SIGHUP and `POST /admin/reload` on a
real `kimi-gateway serve` process while streams flow through it; simulated engines in this process
(their records show what each engine saw and when)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.auth.keys import hash_key
from tests.support import GatewayProcess, RunningGateway, RunningSim, pool
from tests.traffic import Traffic

pytestmark = pytest.mark.anyio

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
USER_KEY = "sk-user-" + uuid.uuid4().hex + uuid.uuid4().hex
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex + uuid.uuid4().hex
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
AUTH = {"enabled": True, "keys": [{"name": "app", "sha256": hash_key(USER_KEY)},
                                  {"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["user", "admin"]}]}


async def poll(check: Callable[[], Any], seconds: float = 10.0, interval: float = 0.02) -> Any:
    """`check()`'s first truthy value (run in a thread), polled every `interval` s; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := await asyncio.to_thread(check)):
        assert time.monotonic() < deadline, f"condition not met within {seconds} s"
        await asyncio.sleep(interval)
    return value


def pools_by_name(gateway: GatewayProcess) -> dict[str, dict[str, Any]]:
    answer = httpx.get(gateway.url + "/admin/workers", headers=ADMIN, timeout=30)
    assert answer.status_code == 200, answer.text
    return {p["name"]: p for p in answer.json()["pools"]}


def healthy_urls(view: dict[str, Any]) -> list[str]:
    return sorted(w["url"] for w in view["workers"] if w["healthy"])


def write_config(path: Path, pools: list[dict[str, Any]]) -> None:
    """The config as the fixture wrote it, with other pools (written whole, then renamed into place)."""
    config = yaml.safe_load(path.read_text())
    config["pools"] = pools
    staged = path.with_suffix(".new")
    staged.write_text(yaml.safe_dump(config))
    staged.replace(path)


async def test_sighup_and_admin_reload_change_pools_while_streams_flow(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, tmp_path: Path) -> None:
    slow = {"ttft_s": 0.02, "tpot_s": 0.03}
    a1, a2, a3 = (start_sim("vllm", max_context_tokens=8192, **slow) for _ in range(3))
    big = start_sim("sglang", max_context_tokens=65536)
    small = {"policy": "round_robin", "default_output_tokens": 16}
    gateway = start_gateway_process([pool("small", "vllm", [a1.url, a2.url], 8192, **small)], auth=AUTH,
                                    health={"interval": 0.2, "timeout": 1.0},
                                    shutdown={"drain_delay": 0, "grace_period": 5})
    config_path = tmp_path / "gateway.yaml"
    first_ids = {w["url"]: w["id"] for w in pools_by_name(gateway)["small"]["workers"]}
    traffic = Traffic(gateway.url, clients=6, max_tokens=30, api_key=USER_KEY).start()
    try:
        await traffic.wait_ok(12)

        # SIGHUP: a1 leaves, a3 joins, a new pool with a larger context appears.
        write_config(config_path, [pool("small", "vllm", [a2.url, a3.url], 8192, **small),
                                   pool("big", "sglang", [big.url], 65536, policy="round_robin")])
        os.kill(gateway.proc.pid, signal.SIGHUP)
        def without_a1() -> dict[str, Any] | None:
            view = pools_by_name(gateway)["small"]
            return view if a1.url not in [w["url"] for w in view["workers"]] else None

        removed = await poll(without_a1, seconds=5, interval=0.005)
        applied_at = time.monotonic()
        await poll(lambda: healthy_urls(pools_by_name(gateway)["small"]) == sorted([a2.url, a3.url])
                   and healthy_urls(pools_by_name(gateway)["big"]) == [big.url])
        await traffic.wait_ok(12)
        assert [r for r in a1.engine.records if r.received_at > applied_at + 0.2] == [], \
            "the removed worker got new requests"
        assert [r for r in a1.engine.records if r.aborted] == [], "a stream on the removed worker was cut"
        # Streams were open on it when the reload came (the gateway's own count); they ran to the end.
        assert next(w["in_flight"] for w in removed["retiring"] if w["url"] == a1.url) > 0
        assert any(r.finished_at is not None and r.finished_at > applied_at for r in a1.engine.records)
        await poll(lambda: len(a3.engine.records) >= 3)
        kept = {w["url"]: w["id"] for w in pools_by_name(gateway)["small"]["workers"]}
        assert kept[a2.url] == first_ids[a2.url] and kept[a3.url] == "small/2"  # ids stay; none reused

        # The new pool takes what only it can hold (a prompt longer than the small pool's context).
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(gateway.url + "/v1/chat/completions", headers={
                "authorization": f"Bearer {USER_KEY}"}, json={
                "model": "kimi-k3", "messages": [{"role": "user", "content": "word " * 8000}], "max_tokens": 2})
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kimi-gateway-pool"] == "big"

            # An invalid config is refused with the reason; the running one stays.
            good = config_path.read_text()
            write_config(config_path, [pool("small", "vllm", [a2.url], -5)])
            os.kill(gateway.proc.pid, signal.SIGHUP)
            await poll(lambda: "reload refused" in gateway.log_text())
            assert "pools.0.max_context_tokens" in gateway.log_text()
            refused = await client.post(gateway.url + "/admin/reload", headers=ADMIN)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["code"] == "invalid_config" and "pools.0.max_context_tokens" in error["message"]
            assert set(pools_by_name(gateway)) == {"small", "big"}
            await traffic.wait_ok(12)

            # POST /admin/reload needs the admin scope, then applies: the big pool goes away.
            config_path.write_text(good)
            write_config(config_path, [pool("small", "vllm", [a2.url, a3.url], 8192, **small)])
            user = await client.post(gateway.url + "/admin/reload", headers={"authorization": f"Bearer {USER_KEY}"})
            assert user.status_code == 403
            assert set(pools_by_name(gateway)) == {"small", "big"}
            reloaded = await client.post(gateway.url + "/admin/reload", headers=ADMIN)
            assert reloaded.status_code == 200, reloaded.text
            assert "pool big removed" in reloaded.json()["changes"]
            assert set(pools_by_name(gateway)) == {"small"}
            await traffic.wait_ok(12)
    finally:
        await traffic.stop()
    assert traffic.failures == []
    assert traffic.ok >= 48


async def test_sighup_to_the_supervisor_reloads_every_serving_process(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, tmp_path: Path) -> None:
    first, second = start_sim("vllm", max_context_tokens=8192), start_sim("vllm", max_context_tokens=8192)
    gateway = start_gateway_process([pool("p", "vllm", [first.url], 8192)], processes=2,
                                    shutdown={"drain_delay": 0, "grace_period": 5})

    def pids() -> set[int]:
        return {httpx.get(gateway.url + "/health", headers={"connection": "close"}).json()["pid"] for _ in range(20)}

    await poll(lambda: len(pids()) == 2, seconds=20)
    write_config(tmp_path / "gateway.yaml", [pool("p", "vllm", [first.url, second.url], 8192)])
    os.kill(gateway.proc.pid, signal.SIGHUP)
    await poll(lambda: gateway.log_text().count("reload applied") == 2)
    assert gateway.proc.poll() is None  # the supervisor passed the signal on instead of dying of it
    views = await asyncio.to_thread(lambda: [httpx.get(gateway.url + "/admin/workers",
                                                       headers={"connection": "close"}).json() for _ in range(20)])
    assert all([w["url"] for w in view["pools"][0]["workers"]] == [first.url, second.url] for view in views)


def test_admin_reload_refuses_another_sites_page_and_a_gateway_without_a_file(
        start_sim: StartSim, start_gateway: Callable[..., RunningGateway]) -> None:
    sim = start_sim("vllm")
    gateway = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    foreign = httpx.post(gateway.url + "/admin/reload", headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "cross_origin_refused"
    # Built from a config object (tests, embedding): the request is fine, the gateway's state forbids it
    # (409, not 400: Schemathesis flagged the 400 as a valid request rejected).
    no_file = httpx.post(gateway.url + "/admin/reload")
    assert no_file.status_code == 409
    assert no_file.json()["error"] == {"message": "There is no config file to reload: this gateway was not started "
                                       "from one.", "type": "invalid_request_error", "param": None,
                                       "code": "no_config_file"}


async def test_requests_queued_in_a_pool_a_reload_removes_get_a_503_not_a_crash(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, tmp_path: Path) -> None:
    # Pool p takes one request at a time; two more wait in its queue when a reload replaces it by q.
    # Woken when the first one ends, they find their pool gone: an OpenAI-style 503 with
    # Retry-After (the SDK's retry reaches pool q), not a 500 from a lookup of the removed pool.
    slow = start_sim("vllm", max_context_tokens=8192, ttft_s=1.5)
    other = start_sim("vllm", max_context_tokens=8192)
    gateway = start_gateway_process([pool("p", "vllm", [slow.url], 8192, max_in_flight=1, queue_timeout=30)],
                                    auth=AUTH, load={"enabled": False})
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    user = {"authorization": f"Bearer {USER_KEY}"}
    async with httpx.AsyncClient(timeout=30) as client:
        sends = [asyncio.create_task(client.post(gateway.url + "/v1/chat/completions", json=body, headers=user))
                 for _ in range(3)]
        await poll(lambda: len(slow.engine.records) == 1)

        def routed() -> float:  # requests past their estimate: the 2nd and 3rd then wait for p's slot
            text = httpx.get(gateway.url + "/metrics", headers=ADMIN).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith('kimi_gateway_estimated_prompt_tokens_count{') and 'pool="p"' in line)

        await poll(lambda: routed() == 3)
        assert not any(s.done() for s in sends)
        write_config(tmp_path / "gateway.yaml", [pool("q", "vllm", [other.url], 8192)])
        reloaded = await client.post(gateway.url + "/admin/reload", headers=ADMIN)
        assert reloaded.status_code == 200, reloaded.text
        answers = await asyncio.gather(*sends)
        assert sorted(a.status_code for a in answers) == [200, 503, 503], [a.text for a in answers]
        for answer in answers:
            if answer.status_code == 503:
                assert answer.headers["retry-after"] == "1"
                assert "pool p" in answer.json()["error"]["message"]
                assert "removed by a reload" in answer.json()["error"]["message"]
        again = await client.post(gateway.url + "/v1/chat/completions", json=body, headers=user)
        assert again.status_code == 200 and again.headers["x-kimi-gateway-pool"] == "q"
    assert len(slow.engine.records) == 1
    assert "Traceback" not in gateway.log_text()
