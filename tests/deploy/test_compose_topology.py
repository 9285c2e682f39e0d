"""The compose demo's topology without Docker: the six engines started from compose.yaml's own sim
commands (parsed by the real `kimi-gateway` command line), two gateway replicas running the shipped
config/k3-production.yaml with compose's environment (demo keys) and one shared Redis, all on
loopback. Both replicas get ready, serve with the demo client key (and refuse without it), and
share prefix affinity through Redis: a prompt first served by one replica goes to the same worker
through the other."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from openai import OpenAI

from gateway.app import create_app
from gateway.cli import build_parser
from gateway.config import load_config
from gateway.serving.request_head import http_options
from gateway.serving.server import ThreadedServer
from tests.conftest import stop_all
from tests.deploy.test_compose import PRODUCTION, compose, compose_value
from tests.support import OwnRedis, RunningSim

DEMO_CLIENT_KEY = "demo-client-key"  # compose.yaml's CLIENT_KEY_SHA256 default is its hash


@pytest.fixture
def topology(start_sim: Callable[..., RunningSim], own_redis: OwnRedis) -> Iterator[list[str]]:
    """Start the compose engines and two gateway replicas; yield the replicas' base URLs."""
    services = compose()["services"]
    env = {k: compose_value(str(v)) for k, v in services["gateway"]["environment"].items()}
    env["REDIS_URL"] = own_redis.url  # compose's `redis` service
    for name, service in services.items():
        if service.get("entrypoint") != ["kimi-gateway", "sim"]:
            continue
        args = build_parser().parse_args(["sim", *map(compose_value, service["command"])])
        sim = start_sim(args.engine, max_context_tokens=args.max_context, served_model_names=args.served_model_name,
                        api_key=args.api_key, kv_capacity_tokens=args.kv_capacity, ttft_s=0.0, tpot_s=0.0)
        pool, index = name.rsplit("-", 1)
        # The variable the plan-derived pool reads its worker URL from: compose's service name -> loopback.
        env[f"{pool.upper().replace('-', '_')}_WORKER_{index}"] = sim.url
    servers: list[ThreadedServer] = []
    for _ in range(services["gateway"]["deploy"]["replicas"]):
        config = load_config(PRODUCTION, environ=env)
        config = config.model_copy(update={"health": config.health.model_copy(update={"interval": 0.5})})
        servers.append(ThreadedServer(create_app(config), **http_options(config)).start())
    yield [s.url for s in servers]
    stop_all(servers)


def wait_ready(url: str, deadline_s: float = 20) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        answer = httpx.get(url + "/ready")
        if answer.status_code == 200 and answer.json()["unready_pools"] == []:  # every pool, not just one
            return
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)


def chat(url: str, prompt: str) -> Any:
    client = OpenAI(base_url=url + "/v1", api_key=DEMO_CLIENT_KEY, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=4, messages=[{"role": "user", "content": prompt}])


def test_two_replicas_serve_the_demo_and_share_affinity(topology: list[str], own_redis: OwnRedis) -> None:
    first, second = topology
    redis_url = own_redis.url
    for url in topology:
        wait_ready(url)  # every pool has a healthy engine: the compose engines are what the plans say
    refused = httpx.post(first + "/v1/chat/completions", json={"model": "kimi-k3", "messages": []})
    assert refused.status_code == 401
    prompt = "A long shared document. " * 600  # ~14 KB: past min_match_tokens (1,024)
    raw = chat(first, prompt)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-kimi-gateway-pool"] == "vllm-128k"
    assert raw.parse().model == "moonshotai/Kimi-K3"  # the engines' served name, from the plan
    worker = raw.headers["x-kimi-gateway-worker"]
    # The first replica writes its affinity records to Redis in the background: wait for them (the
    # Redis is this test's own), then ask the other replica once.
    store = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while not any(True for _ in store.scan_iter("kgw:aff*")):
        assert time.monotonic() < deadline, "no affinity record reached Redis"
        time.sleep(0.05)
    store.close()
    again = chat(second, prompt + " And a follow-up question?")
    assert again.headers["x-kimi-gateway-route-reason"] == "affinity"
    assert again.headers["x-kimi-gateway-worker"] == worker
