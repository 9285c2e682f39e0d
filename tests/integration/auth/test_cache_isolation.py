"""Prefix-cache isolation per API key (issue 37 item 5; gateway/auth/cache_isolation.py).

The probe it stops: tenant B sends the text it guesses tenant A sent and reads the relayed
`cached_tokens` (and the route to A's worker). With `auth.cache_isolation: per_key` the gateway sets
each key's `cache_salt` (replacing any the client sends), the engines keep the keys' cache entries
apart and the prefix-affinity records (in Redis here) are keyed the same way; keys of one
`cache_group` still share. Off (the default), a client's own `cache_salt` passes as it always did.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.auth.cache_isolation import cache_salt
from gateway.auth.keys import hash_key
from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
KEYS = {name: f"sk-{name}-" + uuid.uuid4().hex + uuid.uuid4().hex for name in ("alice", "carol", "bob")}
# ~1,700 tokens: past prefix_affinity's min_match_tokens
SECRET = "Quarterly board memo, strictly confidential: the acquisition price per share is 41.7. " * 80


@pytest.fixture
def affinity_prefix() -> Iterator[str]:
    """A Redis key prefix of the test's own for the affinity records, removed afterwards."""
    prefix = f"kgw-test-iso-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(shared_redis_url())
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def auth(isolation: str) -> dict[str, Any]:
    """alice and carol, one tenant (one `cache_group` when isolated); bob, another."""
    group = {"cache_group": "acme"} if isolation != "off" else {}
    return {"enabled": True, "cache_isolation": isolation, "keys": [
        {"name": "alice", "sha256": hash_key(KEYS["alice"]), **group},
        {"name": "carol", "sha256": hash_key(KEYS["carol"]), **group},
        {"name": "bob", "sha256": hash_key(KEYS["bob"])},
    ]}


def ask(gw: RunningGateway, key: str, api: str = "chat", **extra: Any) -> httpx.Response:
    """The secret prompt as `key`, on chat or Messages; the answer (200 asserted)."""
    if api == "chat":
        body = {"model": "kimi-k3", "max_tokens": 4, "messages": [{"role": "user", "content": SECRET}], **extra}
        response = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {KEYS[key]}"})
    else:
        body = {"model": "kimi-k3", "max_tokens": 4, "messages": [{"role": "user", "content": SECRET}], **extra}
        response = httpx.post(gw.v1 + "/messages", json=body, timeout=30, headers={"x-api-key": KEYS[key]})
    assert response.status_code == 200, response.text
    gw.flush_affinity()
    return response


def cached(response: httpx.Response) -> int:
    usage = response.json()["usage"]
    if "cache_read_input_tokens" in usage:  # Anthropic's
        return int(usage["cache_read_input_tokens"] or 0)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize(("engine", "api", "offload"), [
    ("vllm", "chat", False), ("sglang", "chat", False), ("vllm", "messages", False),
    ("vllm", "chat", True),  # bodies parsed in a parse process (gateway/parsing.py)
])
def test_with_isolation_a_key_reads_nothing_of_another_tenants_cached_prompt(
        start_sim: StartSim, start_gateway: StartGateway, affinity_prefix: str, engine: str, api: str,
        offload: bool) -> None:
    sim = start_sim(engine, kv_capacity_tokens=200_000)  # one worker: every probe lands where the secret is
    gw = start_gateway([pool("p", engine, [sim.url], 131072)], auth=auth("per_key"),
                       redis_url=shared_redis_url(), affinity={"key_prefix": affinity_prefix}, load={"enabled": False},
                       **({"parse_offload_bytes": 1024, "parse_processes": 1} if offload else {}))
    assert cached(ask(gw, "alice", api)) == 0
    # bob probes with the secret, even naming alice's salt itself: nothing cached for him
    assert cached(ask(gw, "bob", api, cache_salt=cache_salt("acme"))) == 0
    assert cached(ask(gw, "carol", api)) > 0  # alice's own tenant shares
    assert cached(ask(gw, "bob", api)) > 0  # bob's own entry from his probe
    salts = [r.body["cache_salt"] for r in sim.engine.records if isinstance(r.body, dict)]
    assert salts == [cache_salt("acme"), cache_salt("bob"), cache_salt("acme"), cache_salt("bob")]


def test_with_isolation_the_affinity_records_are_keyed_per_tenant(
        start_sim: StartSim, start_gateway: StartGateway, affinity_prefix: str) -> None:
    sims = [start_sim("vllm", kv_capacity_tokens=200_000) for _ in range(3)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity")],
                       auth=auth("per_key"), redis_url=shared_redis_url(),
                       affinity={"key_prefix": affinity_prefix}, load={"enabled": False})
    worker = ask(gw, "alice").headers["x-kimi-gateway-worker"]
    probe = ask(gw, "bob")
    assert probe.headers["x-kimi-gateway-route-reason"] == "no_match"  # the secret's blocks are not his
    same_tenant = ask(gw, "carol")
    assert (same_tenant.headers["x-kimi-gateway-worker"], same_tenant.headers["x-kimi-gateway-route-reason"]) == (
        worker, "affinity")


def test_off_is_todays_sharing_and_a_clients_own_salt_passes(
        start_sim: StartSim, start_gateway: StartGateway, affinity_prefix: str) -> None:
    sims = [start_sim("vllm", kv_capacity_tokens=200_000) for _ in range(3)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity")],
                       auth=auth("off"), redis_url=shared_redis_url(),
                       affinity={"key_prefix": affinity_prefix}, load={"enabled": False})
    worker = ask(gw, "alice").headers["x-kimi-gateway-worker"]
    probe = ask(gw, "bob")  # the leak isolation closes: bob is routed to alice's blocks and reads them
    assert (probe.headers["x-kimi-gateway-worker"], probe.headers["x-kimi-gateway-route-reason"]) == (
        worker, "affinity")
    assert cached(probe) > 0
    salted = ask(gw, "bob", cache_salt="bobs-own-salt")
    assert salted.headers["x-kimi-gateway-route-reason"] == "no_match" and cached(salted) == 0
    bodies = [r.body for s in sims for r in s.engine.records if isinstance(r.body, dict)]
    assert sorted(str(b.get("cache_salt")) for b in bodies) == ["None", "None", "bobs-own-salt"]


def test_a_migrated_messages_stream_goes_on_under_its_keys_salt(
        start_sim: StartSim, start_gateway: StartGateway, affinity_prefix: str) -> None:
    """A Messages stream whose worker fails mid-way goes on on another worker's chat API
    (gateway/dispatch/migration.py): that body carries the key's salt too."""
    bad, good = start_sim("vllm", faults=SimFaults(drop_after_chunks=8)), start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")],
                       auth=auth("per_key"), redis_url=shared_redis_url(), affinity={"key_prefix": affinity_prefix},
                       health={"interval": 30, "timeout": 1.0},
                       timeouts={"read": 0.5, "first_byte_base": 0.5, "first_byte_per_1k_tokens": 0})
    body = {"model": "kimi-k3", "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    with httpx.stream("POST", gw.v1 + "/messages", json=body, timeout=15, headers={"x-api-key": KEYS["bob"]}) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_raw())
    assert b"x-kimi-gateway-migrated" in raw and raw.count(b"event: message_stop") == 1
    continued = [r.body for r in good.engine.records if isinstance(r.body, dict)]
    assert [r.path for r in good.engine.records] == ["/v1/chat/completions"]
    assert continued[0]["cache_salt"] == cache_salt("bob")
    assert [r.body["cache_salt"] for r in bad.engine.records] == [cache_salt("bob")]
