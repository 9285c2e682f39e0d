"""A developer's exported KIMI_GATEWAY_* variables must not change what a test's gateway does:
the test fixtures pass their own (empty) environment to `parse_config`."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


@pytest.mark.parametrize(("variable", "value"), [("KIMI_GATEWAY_MAX_ATTEMPTS", "1"),
                                                 ("KIMI_GATEWAY_POOLS", "[]"),
                                                 ("KIMI_GATEWAY_AUTH", '{"enabled": true}')])
def test_exported_gateway_variables_change_nothing(start_sim: StartSim, start_gateway: StartGateway,
                                                   monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    """With pydantic-settings, `KIMI_GATEWAY_MAX_ATTEMPTS=1` exported made this failover a 502 (and
    the other two made the gateway refuse to start)."""
    monkeypatch.setenv(variable, value)
    bad, good = start_sim("vllm", faults=SimFaults(fail_status=503)), start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")])
    answer = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert (answer.headers["x-kimi-gateway-worker"], answer.headers["x-kimi-gateway-attempts"]) == ("p/1", "2")
    assert gw.config.max_attempts == 3 and not gw.config.auth.enabled
