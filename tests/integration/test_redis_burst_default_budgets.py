"""A burst at the production Redis budget (`auth.redis_timeout` 0.05 s, not the tests' 1 s): the
replies of a burst's checks sit unread while the event loop works through the burst, so checks
timed out with a healthy Redis, the limiter took that for an outage, opened its breaker and, with
`fail_mode: open`, every key went unlimited for `redis_retry_after` (found by the attack review:
1,200 concurrent requests of three keys limited to 60 per minute got 335-400 answers each). A
timeout while other checks are queued for a turn is the gateway's own load: that request gets the
busy 503, the limits stay on. The same held for the stored-response store: a flood of lookups
(`responses.lookup_timeout` 0.05 s) opened its breaker, and for `responses.retry_after` every
tenant's lookups answered 503 and the responses they created were never recorded (their follow-ups
404 for good). Real `kimi-gateway serve`, a real redis-server of the test's own."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from tests.integration.test_redis_burst import redis_minute, sha, statuses
from tests.support import GatewayProcess, OwnRedis, RunningSim, free_port, pool

StartSim = Callable[..., RunningSim]
StartGatewayProcess = Callable[..., GatewayProcess]
RPM = 60
KEYS = ("b1", "b2", "b3")
BURST = 400  # concurrent requests of each bursting key
OTHERS = 10
FLOOD = 1500  # concurrent lookups of unknown stored-response ids
CREATED = 5  # responses another tenant creates during the flood

BURST_HEALTH = {"interval": 0.5, "timeout": 5.0, "unhealthy_after": 3}
"""Health probes the burst cannot fail: a simulated worker answering hundreds of requests at once on a
loaded 2-core machine misses the test default's 1 s probe, and a pool of unhealthy workers answers
503 (seen once in a full run: 1,181 x 503 of 1,200)."""


@pytest.fixture
def private_redis() -> Iterator[OwnRedis]:
    server = OwnRedis(free_port())  # not the machine's shared one, which other tests may slow down
    server.start()
    yield server
    server.kill()


def test_a_burst_at_the_default_redis_budget_opens_no_breaker(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, private_redis: OwnRedis) -> None:
    prefix = f"kgw-test-burst-budget-{uuid.uuid4().hex[:8]}"
    keys = [{"name": name, "sha256": sha(f"{name}-key"), "requests_per_minute": RPM} for name in (*KEYS, "other")]
    sim = start_sim("vllm")
    gw = start_gateway_process(pools=[pool("p", "vllm", [sim.url], 131072)], health=BURST_HEALTH,
                               redis_url=private_redis.url,
                               auth={"enabled": True, "keys": keys, "key_prefix": f"{prefix}:rl",
                                     "fail_mode": "open", "redis_timeout": 0.05},
                               affinity={"enabled": False})
    admin = redis.Redis.from_url(private_redis.url)

    Answer = tuple[int, str | None]  # status, error code

    async def run() -> tuple[list[list[int]], list[Answer], Answer]:
        limits = httpx.Limits(max_connections=BURST * len(KEYS) + OTHERS, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            async def others() -> list[Answer]:
                await asyncio.sleep(0.3)  # the burst is under way
                return await asyncio.gather(*(answer_of(client, "other-key") for _ in range(OTHERS)))

            bursts, other = await asyncio.gather(
                asyncio.gather(*(statuses(gw, f"{name}-key", BURST, client) for name in KEYS)), others())
            after = await answer_of(client, "other-key")  # the burst answered: nothing left queued
            return list(bursts), list(other), after

    async def answer_of(client: httpx.AsyncClient, key: str) -> Answer:
        answer = await client.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 1})
        return answer.status_code, answer.json()["error"]["code"] if answer.status_code >= 400 else None

    try:
        minute = redis_minute(admin)
        bursts, other, after = asyncio.run(run())
        crossed = redis_minute(admin) != minute
    finally:
        for key in admin.scan_iter(f"{prefix}:*"):
            admin.delete(key)
        admin.close()
    seen = [Counter(burst) for burst in bursts]
    assert "failing open" not in gw.log_text(), f"the burst was taken for a Redis outage: {seen}"
    for counts in seen:
        assert set(counts) <= {200, 429, 503}, seen
        assert counts[200] == RPM or (crossed and RPM <= counts[200] <= RPM + 2), seen
    # Another key is never charged for the burst: each of its requests is served, or (the gateway's
    # own load on a busy machine: its check queued behind the burst's past the 0.05 s budget) gets
    # the busy 503, never a 429; once the burst is answered it is served at once (no breaker).
    assert {answer for answer in other if answer[0] != 200} <= {(503, "rate_limit_unavailable")}, \
        f"another key during the burst: {Counter(other)}"
    assert after == (200, None), f"another key after the burst: {after}"


def test_a_lookup_flood_at_the_default_budget_opens_no_breaker(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, private_redis: OwnRedis) -> None:
    prefix = f"kgw-test-flood-budget-{uuid.uuid4().hex[:8]}"
    keys = [{"name": name, "sha256": sha(f"{name}-key")} for name in ("flooder", "tenant")]
    sim = start_sim("vllm")
    gw = start_gateway_process(pools=[pool("p", "vllm", [sim.url], 131072)], health=BURST_HEALTH,
                               redis_url=private_redis.url,
                               auth={"enabled": True, "keys": keys}, affinity={"enabled": False},
                               responses={"key_prefix": f"{prefix}:resp", "lookup_timeout": 0.05})
    admin = redis.Redis.from_url(private_redis.url)
    tenant = {"authorization": "Bearer tenant-key"}

    async def run() -> tuple[list[int], list[str]]:
        limits = httpx.Limits(max_connections=FLOOD + CREATED, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            async def lookup() -> int:
                answer = await client.get(f"{gw.url}/v1/responses/resp_{uuid.uuid4().hex}",
                                          headers={"authorization": "Bearer flooder-key"})
                return answer.status_code

            async def create() -> str:
                await asyncio.sleep(0.3)  # the flood is under way
                answer = await client.post(gw.url + "/v1/responses", headers=tenant,
                                           json={"model": "kimi-k3", "input": "hi", "max_output_tokens": 2})
                assert answer.status_code == 200, answer.text
                return str(answer.json()["id"])

            flood, created = await asyncio.gather(asyncio.gather(*(lookup() for _ in range(FLOOD))),
                                                  asyncio.gather(*(create() for _ in range(CREATED))))
            return list(flood), list(created)

    try:
        flood, created = asyncio.run(run())
        deadline = time.monotonic() + 5  # writes are queued, then sent by the store's writer
        while time.monotonic() < deadline and not all(admin.exists(f"{prefix}:resp:{rid}") for rid in created):
            time.sleep(0.05)
        recorded = [bool(admin.exists(f"{prefix}:resp:{rid}")) for rid in created]
    finally:
        for key in admin.scan_iter(f"{prefix}:*"):
            admin.delete(key)
        admin.close()
    seen = f"lookups {Counter(flood)}, the other tenant's responses recorded: {recorded}"
    assert "redis response_lookup failed" not in gw.log_text(), f"the flood was taken for a Redis outage: {seen}"
    assert all(recorded), seen
    assert set(flood) <= {404, 503}, seen


def test_a_burst_at_the_default_affinity_budget_keeps_affinity_on(
        start_sim: StartSim, start_gateway_process: StartGatewayProcess, private_redis: OwnRedis) -> None:
    """The prefix-affinity store's lookups (`affinity.lookup_timeout` 0.05 s) likewise: a burst
    switched affinity off for everyone for `retry_after`, and its writes were dropped."""
    prefix = f"kgw-test-burst-affinity-{uuid.uuid4().hex[:8]}"
    sims = [start_sim("vllm"), start_sim("vllm")]
    gw = start_gateway_process(pools=[pool("p", "vllm", [s.url for s in sims], 131072)], health=BURST_HEALTH,
                               redis_url=private_redis.url,
                               affinity={"enabled": True, "key_prefix": f"{prefix}:aff", "lookup_timeout": 0.05})
    admin = redis.Redis.from_url(private_redis.url)

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=BURST * len(KEYS), max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            return await statuses(gw, "no-key", BURST * len(KEYS), client)

    try:
        answers = asyncio.run(run())
    finally:
        for key in admin.scan_iter(f"{prefix}:*"):
            admin.delete(key)
        admin.close()
    assert Counter(answers) == {200: BURST * len(KEYS)}
    assert "routing without affinity" not in gw.log_text(), "the burst was taken for a Redis outage"
