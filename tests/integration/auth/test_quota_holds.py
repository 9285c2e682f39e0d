"""A key's token limit holds over time (issue 25 §3): what the engine generates for a token-limited
key stays within what the gateway reserved, whatever the request forces (no output limit,
`min_tokens`, `ignore_eos`, `n`), so over several windows the key's total stays within its limit
per window plus one request's reservation. Real gateway, real simulated engine whose model runs far
past the pool's default output, both limiters on a 1 s window."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.redis_limits import RedisRateLimiter
from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HEADERS = {"authorization": f"Bearer {ALICE_KEY}"}
HI = [{"role": "user", "content": "Hi"}]
WINDOW_S = 1.0
WINDOWS = 3
TPM = 1500  # tokens per window here
DEFAULT_OUTPUT = 100  # the pool's reservation when a request sets no output limit
NATURAL_OUTPUT = 2000  # where the engine's model would stop by itself: far past the reservation
MIN_TOKENS = 250


def short_windows(gw: RunningGateway) -> Callable[[], float]:
    """Give the gateway's limiter 1 s windows, the first one starting now; returns its clock."""
    guard = gw.server.app.state.gateway.auth
    assert guard is not None
    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    old = guard.limiter
    if isinstance(old, RedisRateLimiter):
        guard.limiter = RedisRateLimiter(REDIS_URL, old.config, old.metrics, window_s=WINDOW_S, clock=clock)
        gw.server.call(old.stop())
    else:
        guard.limiter = MemoryRateLimiter(window_s=WINDOW_S, clock=clock)
    return clock


# (path, body, the output tokens each completion may use, completions): no body sets an output limit.
REQUESTS: list[tuple[str, dict[str, Any], int, int]] = [
    ("/chat/completions", {"messages": HI}, DEFAULT_OUTPUT, 1),
    ("/chat/completions", {"messages": HI, "stream": True}, DEFAULT_OUTPUT, 1),
    ("/completions", {"prompt": "Hi"}, DEFAULT_OUTPUT, 1),
    ("/responses", {"input": "Hi"}, DEFAULT_OUTPUT, 1),
    ("/chat/completions", {"messages": HI, "min_tokens": MIN_TOKENS}, MIN_TOKENS, 1),  # forces a longer output
    ("/chat/completions", {"messages": HI, "ignore_eos": True, "stream": True}, DEFAULT_OUTPUT, 1),  # to the limit
    ("/chat/completions", {"messages": HI, "n": 2}, DEFAULT_OUTPUT, 2),
]


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_a_token_limit_holds_over_three_windows(start_sim: StartSim, start_gateway: StartGateway, limiter: str,
                                                key_prefix: str) -> None:
    sim = start_sim("vllm", default_output_tokens=NATURAL_OUTPUT, max_context_tokens=16384)
    extra: dict[str, Any] = {"redis_url": REDIS_URL} if limiter == "redis" else {}
    gw = start_gateway([pool("p", "vllm", [sim.url], 16384, default_output_tokens=DEFAULT_OUTPUT)],
                       auth=auth_section({"tokens_per_minute": TPM}, key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False}, **extra)
    clock = short_windows(gw)
    served = refused = 0
    with httpx.Client(base_url=gw.v1, headers=HEADERS, timeout=30) as client:
        i = 0
        while clock() < WINDOWS * WINDOW_S - 0.05:  # every request starts inside the three windows
            path, body, _, _ = REQUESTS[i % len(REQUESTS)]
            response = client.post(path, json={"model": "kimi-k3", **body})
            if response.status_code == 429:
                refused += 1
                time.sleep(0.02)
                continue
            assert response.status_code == 200, response.text
            served += 1
            i += 1
    records = [r for r in sim.engine.records if r.completed]
    assert len(records) == served
    total = sum(r.prompt_tokens + r.completion_tokens_sent for r in records)
    largest_reservation = max(r.prompt_tokens + out * n for r in records for _, _, out, n in REQUESTS)
    assert total <= WINDOWS * TPM + largest_reservation, (total, served)
    assert served >= len(REQUESTS) and refused > 0, (served, refused)  # every shape ran, the limit refused some
    for record in records:  # the engine was told the output limit the gateway reserved
        body = record.body
        limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
        assert limit == (MIN_TOKENS if body.get("min_tokens") else DEFAULT_OUTPUT), body
        assert record.completion_tokens_sent <= limit * (body.get("n") or 1)


@pytest.mark.parametrize("limiter", ["memory", "redis"])
def test_a_stream_that_outlives_its_window_still_pays_its_debt(start_sim: StartSim, start_gateway: StartGateway,
                                                               limiter: str, key_prefix: str) -> None:
    """A stream running past two windows whose engine counted a longer prompt than the gateway
    estimated: what it used beyond its reservation is charged when it ends, to the window then
    current (the one it was charged in is gone)."""
    sim = start_sim("vllm", bytes_per_token=1.0, tpot_s=0.6)  # one token a byte: more than the estimate
    extra: dict[str, Any] = {"redis_url": REDIS_URL} if limiter == "redis" else {}
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, default_output_tokens=DEFAULT_OUTPUT)],
                       auth=auth_section({"tokens_per_minute": 5000}, key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False}, **extra)
    clock = short_windows(gw)
    body = {"model": "kimi-k3", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "x" * 2000}]}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=HEADERS, timeout=30) as response:
        assert response.status_code == 200
        response.read()
    assert clock() > 2 * WINDOW_S  # it ended two windows after it was charged
    record = sim.engine.records[-1]
    estimate = gw.server.app.state.gateway.estimator.utf8_tokens(b"x" * 2000) + 40 + 5  # + template, + output
    debt = record.prompt_tokens + record.completion_tokens_sent - estimate
    assert debt > 1000
    deadline = time.monotonic() + 5
    while True:  # the settlement runs as a task once the stream ended
        # Fits only if the debt was lost; let through, the engine refuses it at once (no engine work, no charge).
        probe = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS,
                           json={"model": "kimi-k3", "messages": HI, "max_tokens": 5000 - debt // 2,
                                 "x_sim_faults": {"fail_status": 400}})
        if probe.status_code == 429 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert probe.status_code == 429, "the debt was not charged"
