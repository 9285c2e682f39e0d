"""A limited key learns its remaining budget before it is refused (issue 37 §9), through a real gateway
with its limits on the real Redis: OpenAI's `x-ratelimit-*` headers on the OpenAI APIs and
Anthropic's `anthropic-ratelimit-*` on `/v1/messages`, on answers, in a stream's response head and
on the 429 (with `retry-after`), read through the real SDKs; the tighter of a key's own limit and its
limit on the model is the one shown; a key without limits gets none."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.auth.keys import hash_key
from tests.integration.auth.conftest import ALICE_KEY, OPS_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
BOB_KEY = "sk-bob-" + "b" * 48
HI = [{"role": "user", "content": "Hi"}]
OPENAI = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
          "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
ANTHROPIC = ("anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining",
             "anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-limit",
             "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset")


def gateway(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str) -> RunningGateway:
    """alice: 3 requests and 2,000 tokens a minute; bob: 50 requests a minute, but 2 on kimi-k3."""
    sim = start_sim("vllm")
    auth = auth_section({"requests_per_minute": 3, "tokens_per_minute": 2000}, key_prefix=key_prefix)
    auth["keys"].append({"name": "bob", "sha256": hash_key(BOB_KEY), "requests_per_minute": 50,
                         "model_limits": {"kimi-k3": {"requests_per_minute": 2}}})
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth, redis_url=REDIS_URL,
                         affinity={"enabled": False}, load={"enabled": False})


def go_duration(text: str) -> float:
    """Seconds of a Go duration as OpenAI sends them (`17ms`, `1.5s`, `1m59.9s`)."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?|(\d+)ms", text)
    assert match is not None and text, text
    if match.group(3) is not None:
        return int(match.group(3)) / 1000
    return int(match.group(1) or 0) * 60 + float(match.group(2) or 0)


def standing(headers: Any, names: tuple[str, ...] = OPENAI) -> dict[str, str]:
    return {name: headers[name] for name in names if name in headers}


def test_openai_answers_stream_heads_and_429s_carry_the_keys_budget(
        start_sim: StartSim, start_gateway: StartGateway, key_prefix: str) -> None:
    gw = gateway(start_sim, start_gateway, key_prefix)
    start_a_window_now(gw)
    with openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0) as sdk:
        first = sdk.chat.completions.with_raw_response.create(model="kimi-k3", messages=HI, max_tokens=100)
        head = standing(first.headers)
        estimated = int(first.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
        assert {k: v for k, v in head.items() if "reset" not in k} == {
            "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2",
            "x-ratelimit-limit-tokens": "2000", "x-ratelimit-remaining-tokens": str(2000 - estimated - 100)}
        # counted in a window that just began: back to the initial state once the next one ended
        assert 60 < go_duration(head["x-ratelimit-reset-requests"]) <= 120
        assert 60 < go_duration(head["x-ratelimit-reset-tokens"]) <= 120

        with sdk.chat.completions.with_streaming_response.create(model="kimi-k3", messages=HI, max_tokens=5,
                                                                 stream=True) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
            used = 2000 - int(streamed.headers["x-ratelimit-remaining-tokens"])
            assert estimated + 5 < used < estimated + 100 + estimated + 5  # the first settled to its usage
            assert "data: [DONE]" in "".join(streamed.iter_lines())
        last = sdk.completions.with_raw_response.create(model="kimi-k3", prompt="Hi", max_tokens=2)
        assert last.headers["x-ratelimit-remaining-requests"] == "0"

        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model="kimi-k3", messages=HI, max_tokens=2)
        headers = refused.value.response.headers
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "0")
        assert 1 <= int(headers["retry-after"]) <= go_duration(headers["x-ratelimit-reset-requests"]) + 1
        assert "x-ratelimit-limit-tokens" in headers and "anthropic-ratelimit-requests-limit" not in headers

    with openai.OpenAI(base_url=gw.v1, api_key=OPS_KEY, max_retries=0) as unlimited:
        answer = unlimited.chat.completions.with_raw_response.create(model="kimi-k3", messages=HI, max_tokens=2)
        assert standing(answer.headers) == {}


def test_anthropic_messages_carry_anthropics_headers(start_sim: StartSim, start_gateway: StartGateway,
                                                     key_prefix: str) -> None:
    gw = gateway(start_sim, start_gateway, key_prefix)
    start_a_window_now(gw)
    with anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0) as claude:
        answer = claude.messages.with_raw_response.create(model="kimi-k3", max_tokens=50, messages=HI)
        head = standing(answer.headers, ANTHROPIC)
        assert (head["anthropic-ratelimit-requests-limit"], head["anthropic-ratelimit-requests-remaining"],
                head["anthropic-ratelimit-tokens-limit"]) == ("3", "2", "2000")
        assert int(head["anthropic-ratelimit-tokens-remaining"]) < 2000 - 50
        now = time.time()
        for kind in ("requests", "tokens"):  # RFC 3339, UTC: when the budget is whole again
            reset = datetime.fromisoformat(head[f"anthropic-ratelimit-{kind}-reset"].replace("Z", "+00:00"))
            assert reset.tzinfo is not None and now + 55 < reset.timestamp() < now + 125
        assert standing(answer.headers) == {}  # not OpenAI's names on Anthropic's API

        with claude.messages.with_streaming_response.create(model="kimi-k3", max_tokens=5, messages=HI,
                                                            stream=True) as streamed:
            assert streamed.headers["anthropic-ratelimit-requests-remaining"] == "1"
            assert "message_stop" in "".join(streamed.iter_lines())
        claude.messages.create(model="kimi-k3", max_tokens=5, messages=HI)
        with pytest.raises(anthropic.RateLimitError) as refused:
            claude.messages.create(model="kimi-k3", max_tokens=5, messages=HI)
        headers = refused.value.response.headers
        assert headers["anthropic-ratelimit-requests-remaining"] == "0" and int(headers["retry-after"]) >= 1


def test_the_tighter_of_a_keys_limit_and_its_models_is_shown(start_sim: StartSim, start_gateway: StartGateway,
                                                              key_prefix: str) -> None:
    gw = gateway(start_sim, start_gateway, key_prefix)
    start_a_window_now(gw)
    heads = []
    for _ in range(2):
        answer = httpx.post(gw.v1 + "/chat/completions", headers={"authorization": f"Bearer {BOB_KEY}"},
                            json={"model": "kimi-k3", "messages": HI, "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200
        heads.append(standing(answer.headers))
    assert [(h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) for h in heads] == [
        ("2", "1"), ("2", "0")]  # kimi-k3's 2 a minute, not bob's 50
    assert "x-ratelimit-limit-tokens" not in heads[0]  # bob has no token limit
