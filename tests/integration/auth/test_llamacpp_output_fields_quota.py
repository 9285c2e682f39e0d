"""A token-limited key cannot make llama.cpp generate past its reservation with `n_predict`, the
server's own output limit, which it copies over the one `max_tokens` gives (`tools/server/
server-common.cpp`, `oaicompat_chat_params_parse`; `server-task.cpp`, `params_from_json_cmpl`),
-1 meaning no limit. Found by the attack review: `{"max_tokens": 1, "n_predict": 400}` was charged
one output token and reached the engine as sent. The reservation covers a positive `n_predict` and
the engine gets the reserved limit in it. The simulator speaks vLLM's API (it has no llama.cpp
kind); the pool says llama.cpp, and the test reads what the worker received."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HEADERS = {"authorization": f"Bearer {ALICE_KEY}"}
HI = [{"role": "user", "content": "Hi"}]  # estimated at 41 prompt tokens
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"messages": HI}),
    "completions": ("/completions", {"prompt": "Hi"}),
}


def gateway(start_sim: StartSim, start_gateway: StartGateway, limiter: str, key_prefix: str,
            tpm: int, **settings: Any) -> tuple[RunningSim, RunningGateway]:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "llamacpp", [sim.url], 8192, default_output_tokens=50)],
                       auth=auth_section({"tokens_per_minute": tpm}, key_prefix=key_prefix),
                       affinity={"enabled": False}, load={"enabled": False},
                       **({"redis_url": REDIS_URL} if limiter == "redis" else {}), **settings)
    start_a_window_now(gw)
    return sim, gw


@pytest.mark.parametrize("limiter", ["memory", "redis"])
@pytest.mark.parametrize("api", list(BODIES))
def test_n_predict_is_reserved(start_sim: StartSim, start_gateway: StartGateway, limiter: str, key_prefix: str,
                               api: str) -> None:
    sim, gw = gateway(start_sim, start_gateway, limiter, key_prefix, tpm=300)
    path, body = BODIES[api]
    answer = httpx.post(gw.v1 + path, headers=HEADERS, timeout=10,
                        json={"model": "kimi-k3", **body, "max_tokens": 1, "n_predict": 400})
    assert answer.status_code == 429, answer.text  # 400 output tokens do not fit 300 a minute
    assert "Request too large" in answer.json()["error"]["message"]
    assert sim.engine.records == []


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("api", list(BODIES))
@pytest.mark.parametrize(("sent", "reserved"), [(-1, 50), (0, 50), (20, 20), (-3.5, 50)])
def test_the_engine_gets_the_reserved_n_predict(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str,
                                                api: str, sent: float, reserved: int, offload: bool) -> None:
    """-1 (llama.cpp's "no limit") and other numbers below 1 get the pool's reservation (50); a
    positive one is kept: it was reserved."""
    settings = {"parse_offload_bytes": 1} if offload else {}  # also through a parse process's ForwardBody
    sim, gw = gateway(start_sim, start_gateway, "memory", key_prefix, tpm=100000, **settings)
    path, body = BODIES[api]
    answer = httpx.post(gw.v1 + path, headers=HEADERS, timeout=10,
                        json={"model": "kimi-k3", **body, "n_predict": sent})
    assert answer.status_code == 200, answer.text
    [record] = sim.engine.records
    assert record.body["n_predict"] == reserved, record.body


@pytest.mark.parametrize("api", list(BODIES))
def test_n_cmpl_is_reserved(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str, api: str) -> None:
    """llama.cpp's `n_cmpl` (completions per prompt, read before `n`) multiplies the reservation as `n` does."""
    sim, gw = gateway(start_sim, start_gateway, "memory", key_prefix, tpm=300)
    path, body = BODIES[api]
    answer = httpx.post(gw.v1 + path, headers=HEADERS, timeout=10,
                        json={"model": "kimi-k3", **body, "max_tokens": 100, "n_cmpl": 4})
    assert answer.status_code == 429, answer.text  # 4 x 100 output tokens do not fit 300 a minute
    assert sim.engine.records == []
