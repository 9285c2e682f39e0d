"""Issue 26 §8: Redis Cluster (gateway/redis_cluster.py).

The module starts its own 3-shard cluster: three real `redis-server --cluster-enabled yes` processes
on free loopback ports (their bus ports too, `--cluster-port`), joined by `redis-cli --cluster create`,
and stopped at the end. With `redis+cluster://` the per-key limits hold for keys on every shard, and
affinity, stored responses and shared drains work through a real gateway; a plain `redis://` URL
naming one node (which would reach only that node's third of the slots) is refused by the gateway's
connections (`kimi_gateway_redis_up` 0, errors counted, a log line saying what to do) and reported
by `check-config --strict`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.cluster
import yaml

from gateway.auth.keys import Principal
from gateway.auth.params import AuthConfig
from gateway.auth.redis_limits import RedisRateLimiter
from gateway.cli import main
from gateway.observability.metrics import GatewayMetrics
from gateway.redis_client import redis_from_url
from gateway.redis_cluster import GatewayCluster
from tests.support import RunningGateway, RunningSim, free_ports, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
SHARDS = 3


class Cluster:
    """Three primaries (no replicas) holding the 16384 slots between them, on loopback."""

    def __init__(self, workdir: Path) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert binary and cli, "redis-server and redis-cli must be installed"
        ports = free_ports(2 * SHARDS)
        self.ports, self.bus_ports = ports[:SHARDS], ports[SHARDS:]
        self.procs = [subprocess.Popen(
            [binary, "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for port, bus in zip(self.ports, self.bus_ports, strict=True)]
        for port in self.ports:
            self._wait(lambda p=port: bool(self.node(p).ping()), "node up")  # type: ignore[misc]
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        for port in self.ports:
            self._wait(lambda p=port: self.node(p).cluster("info")["cluster_state"] == "ok",  # type: ignore[misc]
                       "cluster state ok")
        self.client = redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], decode_responses=True)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @staticmethod
    def node(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, decode_responses=True)

    @staticmethod
    def _wait(check: Callable[[], bool], what: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except (redis.RedisError, OSError):
                pass
            assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
            time.sleep(0.05)

    def port_of(self, key: str) -> int:
        """The port of the primary that holds `key`'s slot."""
        return int(self.client.get_node_from_key(key).port)

    def move_slot(self, slot: int, source: int, target: int) -> None:
        """Reshard `slot` with its keys from the primary on port `source` to the one on `target`
        (CLUSTER SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE), as `redis-cli --cluster reshard` does."""
        src, dst = self.node(source), self.node(target)
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        dst.cluster("setslot", slot, "importing", src_id)
        src.cluster("setslot", slot, "migrating", dst_id)
        while keys := src.cluster("getkeysinslot", slot, 100):
            src.migrate("127.0.0.1", target, keys, 0, 5000)
        for port in self.ports:
            self.node(port).cluster("setslot", slot, "node", dst_id)
        self.client.nodes_manager.initialize()  # the test's own client reads the new map

    def keys(self, pattern: str) -> list[str]:
        return [k for p in self.ports for k in self.node(p).scan_iter(pattern, count=1000)]

    def stop(self) -> None:
        self.client.close()
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = Cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield group
    finally:
        group.stop()


async def allowed(limiter: RedisRateLimiter, principal: Principal) -> bool:
    """One request charged to `principal`: whether the limiter let it through (Redis must answer)."""
    verdict = await limiter.acquire(principal, tokens=0)
    assert verdict is not None, f"{principal.name}: Redis did not answer (the limiter would fail open)"
    return verdict.allowed


@pytest.mark.anyio
async def test_rate_limits_hold_for_keys_on_every_shard(cluster: Cluster) -> None:
    prefix = f"kgw-test-cluster-rl-{uuid.uuid4().hex[:8]}"
    limiter = RedisRateLimiter(cluster.url, AuthConfig(key_prefix=prefix, redis_timeout=1.0), GatewayMetrics())
    names = [f"key-{i}" for i in range(60)]
    shards = {cluster.port_of(limiter.key(name)) for name in names}
    assert shards == set(cluster.ports), "the keys spread over every shard"
    try:
        for name in names:
            principal = Principal(name, frozenset(), requests_per_minute=2)
            assert [await allowed(limiter, principal) for _ in range(3)] == [True, True, False], name
        assert {cluster.client.hget(limiter.key(name), "r") for name in names} == {"2"}
    finally:
        await limiter.stop()
        for key in cluster.keys(f"{prefix}:*"):
            cluster.client.delete(key)


@pytest.mark.anyio
async def test_the_slot_map_read_outlives_a_store_timeout_and_starts_with_the_store(cluster: Cluster) -> None:
    # Reading the map (CLUSTER SLOTS + COMMAND) takes ~25 ms here, more than an affinity lookup's 20 ms.
    client = await asyncio.to_thread(cluster_client, cluster.url)  # built outside a loop: nothing read yet
    assert client._initialize
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.001):  # a store's budget running out while the map is read
                await client.get("kgw-test-cluster-absent")
        await wait_until(lambda: not client._initialize)  # went on reading: the next call is served at once
        assert await client.get("kgw-test-cluster-absent") is None
    finally:
        await client.aclose()
    eager = redis_from_url(cluster.url, socket_timeout=2)  # a store built in the app's lifespan
    try:
        await wait_until(lambda: not eager._initialize)  # read before any command
    finally:
        await eager.aclose()


def cluster_client(url: str) -> GatewayCluster:
    """The stores' cluster client for `url`."""
    client = redis_from_url(url, socket_timeout=2)
    assert isinstance(client, GatewayCluster)
    return client


async def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_limits_follow_a_slot_moved_to_another_shard(cluster: Cluster) -> None:
    prefix = f"kgw-test-cluster-move-{uuid.uuid4().hex[:8]}"
    metrics = GatewayMetrics()
    limiter = RedisRateLimiter(cluster.url, AuthConfig(key_prefix=prefix, redis_timeout=1.0), metrics)
    principal = Principal("mover", frozenset(), requests_per_minute=3)
    key = limiter.key(principal.name)
    try:
        assert [await allowed(limiter, principal) for _ in range(2)] == [True, True]
        source = cluster.port_of(key)
        target = next(p for p in cluster.ports if p != source)
        cluster.move_slot(int(cluster.client.keyslot(key)), source, target)
        assert cluster.node(target).hget(key, "r") == "2"  # the count moved with its slot
        # The limiter's map still names the source, which answers MOVED: followed, counted on the target.
        assert [await allowed(limiter, principal) for _ in range(2)] == [True, False]
        assert cluster.node(target).hget(key, "r") == "3"
    finally:
        await limiter.stop()
        for stale in cluster.keys(f"{prefix}:*"):
            cluster.client.delete(stale)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_limits_affinity_stored_responses_and_drains_through_a_gateway(
        cluster: Cluster, start_sim: StartSim, start_gateway: StartGateway) -> None:
    prefix = f"kgw-test-cluster-{uuid.uuid4().hex[:8]}"
    names = [f"k{i}" for i in range(12)]
    assert {cluster.port_of(f"{prefix}:rl:{n}") for n in names} == set(cluster.ports)
    keys = [{"name": n, "sha256": sha(f"{n}-secret"), "requests_per_minute": 2} for n in names]
    keys += [{"name": "bulk", "sha256": sha("bulk-secret")}, {"name": "ops", "sha256": sha("ops-secret"),
                                                               "scopes": ["admin"]}]
    sims = [start_sim("vllm", max_context_tokens=131072) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)], redis_url=cluster.url,
                       load={"enabled": False},
                       auth={"enabled": True, "keys": keys, "key_prefix": f"{prefix}:rl"},
                       affinity={"key_prefix": f"{prefix}:aff"}, responses={"key_prefix": f"{prefix}:resp"})
    try:
        def chat(secret: str, text: str = "hi") -> httpx.Response:
            return httpx.post(gw.v1 + "/chat/completions", headers={"authorization": f"Bearer {secret}"}, timeout=10,
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": text}],
                                    "max_tokens": 1})

        for name in names:  # limits on every shard
            assert [chat(f"{name}-secret").status_code for _ in range(3)] == [200, 200, 429], name
        # Affinity: prompts with distinct first blocks land on every shard; a prompt seen once is a hit after.
        prompts = [f"conversation {i} " + "context " * 300 for i in range(12)]
        owners = {p: chat("bulk-secret", p).headers["x-kimi-gateway-worker"] for p in prompts}
        gw.flush_affinity()
        written = cluster.keys(f"{prefix}:aff:*")
        assert {cluster.port_of(k) for k in written} == set(cluster.ports) and len(written) >= 12 * 5
        hits = gw.metric('kimi_gateway_affinity_lookups_total{pool="p",result="hit"}')
        for p, owner in owners.items():
            assert chat("bulk-secret", p).headers["x-kimi-gateway-worker"] == owner
        assert gw.metric('kimi_gateway_affinity_lookups_total{pool="p",result="hit"}') == hits + len(prompts)
        # Stored responses: a follow-up reaches the worker that stores the first answer.
        c = openai.OpenAI(base_url=gw.v1, api_key="bulk-secret", max_retries=0)
        previous, owner = None, None
        for turn in range(4):
            raw = c.responses.with_raw_response.create(model="kimi-k3", input=f"Turn {turn}", max_output_tokens=2,
                                                       previous_response_id=previous)
            owner = owner or raw.headers["x-kimi-gateway-worker"]
            assert raw.headers["x-kimi-gateway-worker"] == owner, turn
            previous = raw.parse().id
            gw.server.call(gw.server.app.state.gateway.responses.flush())
        assert cluster.client.get(f"{prefix}:resp:{previous}").startswith("p\n")
        # A drain goes to Redis (shared) and back.
        admin = {"authorization": "Bearer ops-secret"}
        answer = httpx.post(gw.url + "/admin/workers/p/1/drain", headers=admin, timeout=5)
        assert answer.status_code == 200 and answer.json()["shared"] is True, answer.text
        assert cluster.client.smembers(f"{prefix}:aff:drained-urls") == {f"p {sims[1].url}"}
        assert httpx.post(gw.url + "/admin/workers/p/1/undrain", headers=admin, timeout=5).json()["shared"] is True
        assert cluster.client.smembers(f"{prefix}:aff:drained-urls") == set()
        assert gw.metric("kimi_gateway_redis_up ") == 1
        assert gw.metric("kimi_gateway_redis_errors_total") == 0
    finally:
        for key in cluster.keys(f"{prefix}:*"):
            cluster.client.delete(key)


def test_a_plain_url_naming_a_cluster_node_is_refused_and_reported(
        cluster: Cluster, start_sim: StartSim, start_gateway: StartGateway, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    plain = f"redis://127.0.0.1:{cluster.ports[0]}/0"
    prefix = f"kgw-test-cluster-plain-{uuid.uuid4().hex[:8]}"
    names = [f"k{i}" for i in range(6)]
    assert {cluster.port_of(f"{prefix}:rl:{n}") for n in names} == set(cluster.ports)
    sim = start_sim("vllm")
    caplog.set_level(logging.WARNING)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], redis_url=plain,
                       auth={"enabled": True, "key_prefix": f"{prefix}:rl", "fail_mode": "closed",
                             "keys": [{"name": n, "sha256": sha(f"{n}-secret"), "requests_per_minute": 100}
                                      for n in names]},
                       affinity={"key_prefix": f"{prefix}:aff"})
    try:
        statuses = [httpx.post(gw.v1 + "/chat/completions", headers={"authorization": f"Bearer {n}-secret"},
                               json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 1}, timeout=10).status_code for n in names]
        # Not a third of the keys limited and the rest failing: every key sees the refused Redis alike.
        assert statuses == [503] * len(names), statuses
        assert gw.metric('kimi_gateway_redis_errors_total{op="rate_limit"}') >= 1
        deadline = time.monotonic() + 10
        while gw.metric("kimi_gateway_redis_up ") != 0:
            assert time.monotonic() < deadline, "kimi_gateway_redis_up stayed 1 for a Redis the gateway cannot use"
            time.sleep(0.1)
        assert "is a Redis Cluster node" in caplog.text and "redis+cluster://" in caplog.text
        assert cluster.keys(f"{prefix}:*") == []
    finally:
        for key in cluster.keys(f"{prefix}:*"):
            cluster.client.delete(key)
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"redis_url": plain, "pools": [pool("p", "vllm", [sim.url], 131072)]}))
    with pytest.raises(SystemExit) as exited:
        main(["check-config", "--strict", str(config)])
    assert "check-config --strict" in str(exited.value.code)
    assert "Redis Cluster node" in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"redis_url": cluster.url, "pools": [pool("p", "vllm", [sim.url], 131072)]}))
    main(["check-config", "--strict", str(config)])  # the cluster URL: no warning, no exit
    assert "warning" not in capsys.readouterr().out
