"""Retry advice on the gateway's own answers (issue 37 §14), through a real gateway with its limits on
the real Redis: an answer no retry can change (401, 403, 404, 400, 405, 409) carries
`x-should-retry: false`, which the real OpenAI and Anthropic SDKs obey before the status
(`_should_retry` in their `_base_client.py`); 429 and 5xx answers carry none, so the SDKs keep
retrying those as they should."""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import httpx
import httpx2
import openai
import pytest

from gateway.auth.keys import hash_key
from tests.integration.auth.conftest import ALICE_KEY, OPS_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
DRAIN_KEY = "sk-drain-" + "d" * 48
HI = [{"role": "user", "content": "Hi"}]


def gateway(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str, unused_port: int) -> RunningGateway:
    sim = start_sim("vllm", max_context_tokens=4096)
    auth = auth_section({"requests_per_minute": 3}, key_prefix=key_prefix)
    auth["keys"].append({"name": "drainer", "sha256": hash_key(DRAIN_KEY), "scopes": ["drain"]})
    return start_gateway([pool("p", "vllm", [sim.url], 4096),
                          pool("down", "vllm", [f"http://127.0.0.1:{unused_port}"], 4096)],
                         models=[{"name": "kimi-k3", "pools": ["p"]}, {"name": "gone", "pools": ["down"]}],
                         auth=auth, redis_url=REDIS_URL, affinity={"enabled": False}, load={"enabled": False})


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def counting_client(seen: list[str]) -> httpx2.Client:
    """An HTTP client of the SDKs' own kind that notes every request they send (retries included)."""
    return httpx2.Client(event_hooks={"request": [lambda request: seen.append(request.url.path)]})


def test_final_answers_say_do_not_retry_and_the_sdks_obey(start_sim: StartSim, start_gateway: StartGateway,
                                                           key_prefix: str, unused_port: int) -> None:
    gw = gateway(start_sim, start_gateway, key_prefix, unused_port)
    chat = gw.v1 + "/chat/completions"
    http = httpx.Client(timeout=60)
    final = {
        "401 no key": http.post(chat, json={"model": "kimi-k3", "messages": HI}),
        "401 wrong key": http.post(chat, json={"model": "kimi-k3", "messages": HI}, headers=bearer("sk-wrong")),
        "401 wrong key, Anthropic": http.post(gw.v1 + "/messages", json={"model": "kimi-k3", "messages": HI},
                                               headers={"x-api-key": "sk-wrong"}),
        "401 wrong key, model list": http.get(gw.v1 + "/models", headers=bearer("sk-wrong")),
        "403 scope": http.post(chat, json={"model": "kimi-k3", "messages": HI}, headers=bearer(DRAIN_KEY)),
        "403 admin scope": http.get(gw.url + "/admin/workers", headers=bearer(ALICE_KEY)),
        "404 model": http.post(chat, json={"model": "nope", "messages": HI}, headers=bearer(OPS_KEY)),
        "404 retrieve": http.get(gw.v1 + "/models/nope", headers=bearer(OPS_KEY)),
        "404 path": http.post(gw.v1 + "/nope", json={}, headers=bearer(OPS_KEY)),
        "400 body": http.post(chat, json={"model": "kimi-k3"}, headers=bearer(OPS_KEY)),
        "400 too long": http.post(chat, json={"model": "kimi-k3", "messages": HI, "max_tokens": 5000},
                                   headers=bearer(OPS_KEY)),
        "405": http.get(chat, headers=bearer(OPS_KEY)),
        "409": http.post(gw.url + "/admin/reload", headers=bearer(OPS_KEY)),
    }
    assert {what: (answer.status_code, answer.headers.get("x-should-retry")) for what, answer in final.items()} == {
        what: (int(what[:3]), "false") for what in final}

    start_a_window_now(gw)
    for _ in range(3):
        assert http.post(chat, json={"model": "kimi-k3", "messages": HI, "max_tokens": 2},
                          headers=bearer(ALICE_KEY)).status_code == 200
    passing = {
        "429": http.post(chat, json={"model": "kimi-k3", "messages": HI, "max_tokens": 2}, headers=bearer(ALICE_KEY)),
        "5xx": http.post(chat, json={"model": "gone", "messages": HI, "max_tokens": 2}, headers=bearer(OPS_KEY)),
        "5xx, Anthropic": http.post(gw.v1 + "/messages", json={"model": "gone", "messages": HI, "max_tokens": 2},
                                    headers={"x-api-key": OPS_KEY}),
    }
    http.close()
    # no worker can answer for `gone` (503, Anthropic's 529; a 502 if its probe has not yet failed)
    assert {what: (answer.status_code if what == "429" else answer.status_code // 100,
                   answer.headers.get("x-should-retry")) for what, answer in passing.items()} == {
        "429": (429, None), "5xx": (5, None), "5xx, Anthropic": (5, None)}

    # The SDKs: a 409 (which they would retry as a lock timeout) and a wrong key are sent once; a
    # 429 and a 503 are still theirs to retry.
    seen: list[str] = []
    with (openai.OpenAI(base_url=gw.url, api_key=OPS_KEY, max_retries=2, http_client=counting_client(seen)) as sdk,
          openai.OpenAI(base_url=gw.v1, api_key="sk-wrong", max_retries=2,
                        http_client=counting_client(seen)) as wrong,
          anthropic.Anthropic(base_url=gw.url, api_key=OPS_KEY, max_retries=2,
                              http_client=counting_client(seen)) as claude):
        with pytest.raises(openai.ConflictError):
            sdk.post("/admin/reload", cast_to=object)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="kimi-k3", messages=HI)  # type: ignore[arg-type]
        with pytest.raises(anthropic.ConflictError):
            claude.post("/admin/reload", cast_to=object)
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.create(model="nope", max_tokens=2, messages=HI)  # type: ignore[arg-type]
    assert seen == ["/admin/reload", "/v1/chat/completions", "/admin/reload", "/v1/messages"]
    for answer in passing.values():
        assert sdk._should_retry(answer) and claude._should_retry(answer)
    for answer in final.values():
        assert not sdk._should_retry(answer) and not claude._should_retry(answer)


