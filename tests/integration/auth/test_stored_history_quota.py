"""A key's token reservation covers what the engine prefills (issue 37 §1): a Responses follow-up's
stored conversation (`previous_response_id`), and token ids an engine takes on its chat route instead
of the rendered messages. Real gateway, real Redis (limiter and response store), simulated engines
that prefill the stored conversation and the token ids as vLLM and SGLang do."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.sim.worker_state import SimRequestRecord
from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section, start_a_window_now
from tests.integration.auth.test_quota_settle_http import HEADERS, until, used_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
TPM = 10_000
HISTORY = "Tell me about the weather. " * 300  # 8,100 bytes: about 2,000 tokens the engine stores


@pytest.fixture
def prefix() -> Iterator[str]:
    """A Redis key prefix of the test's own (limits, stored responses), its keys deleted afterwards."""
    name = f"test-hist-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{name}*"))
    if keys:
        client.delete(*keys)
    client.close()


def gateway(start_gateway: StartGateway, sim: RunningSim, prefix: str, engine: str = "vllm",
            **pool_settings: Any) -> RunningGateway:
    gw = start_gateway([pool("p", engine, [sim.url], 131072, default_output_tokens=500, **pool_settings)],
                       auth=auth_section({"tokens_per_minute": TPM, "requests_per_minute": 1000},
                                         key_prefix=prefix + "-rl"),
                       redis_url=REDIS_URL, responses={"key_prefix": prefix + "-resp"},
                       affinity={"enabled": False}, load={"enabled": False})
    start_a_window_now(gw)
    return gw


def flush(gw: RunningGateway) -> None:
    """Wait until the gateway's response store wrote what it was told (Redis writes are queued)."""
    gw.server.call(gw.server.app.state.gateway.responses.flush())


def created(gw: RunningGateway, sim: RunningSim) -> tuple[str, int]:
    """A stored response with a large conversation: its id and what the key was charged for it."""
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    first = sdk.responses.create(model="kimi-k3", input=HISTORY, max_output_tokens=4)
    assert first.usage is not None and first.usage.input_tokens > 2000
    flush(gw)
    charged = used_now(gw, TPM)
    assert charged == first.usage.total_tokens
    return first.id, charged


def last_record(sim: RunningSim) -> SimRequestRecord:
    return sim.engine.records[-1]


def test_a_burst_of_follow_ups_is_held_to_the_budget(start_sim: StartSim, start_gateway: StartGateway,
                                                     prefix: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = gateway(start_gateway, sim, prefix)
    rid, _ = created(gw, sim)

    def follow_up(_: int) -> int:
        response = httpx.post(gw.v1 + "/responses", headers=HEADERS, timeout=60, json={
            "model": "kimi-k3", "input": "And tomorrow?", "previous_response_id": rid, "max_output_tokens": 4})
        assert response.status_code in (200, 429), response.text
        return response.status_code

    with ThreadPoolExecutor(12) as pool_:
        statuses = list(pool_.map(follow_up, range(12)))
    served = statuses.count(200)
    history = last_record(sim).prompt_tokens
    assert history > 2000  # the engine prefilled the stored conversation for each follow-up
    assert 1 <= served <= TPM // history, statuses
    used = used_now(gw, TPM)  # a JSON answer is settled before it is sent
    assert used <= TPM, f"{served} follow-ups used {used} tokens of a {TPM}-token minute"


def test_a_follow_up_whose_client_hangs_up_is_charged_its_stored_history(
        start_sim: StartSim, start_gateway: StartGateway, prefix: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = gateway(start_gateway, sim, prefix)
    rid, before = created(gw, sim)
    with httpx.stream("POST", gw.v1 + "/responses", headers=HEADERS, timeout=60, json={
            "model": "kimi-k3", "input": "And tomorrow?", "previous_response_id": rid,
            "max_output_tokens": 200, "stream": True}) as response:  # 10 s of output
        assert response.status_code == 200
        next(response.iter_bytes())
    until(lambda: last_record(sim).aborted, timeout=30)  # the gateway closed the engine's stream
    engine = last_record(sim)
    assert engine.prompt_tokens > 2000
    until(lambda: used_now(gw, TPM) - before >= engine.prompt_tokens + engine.completion_tokens_sent, timeout=10)


def test_a_background_follow_up_and_its_own_follow_up_are_charged_their_history(
        start_sim: StartSim, start_gateway: StartGateway, prefix: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = gateway(start_gateway, sim, prefix)
    rid, before = created(gw, sim)
    queued = httpx.post(gw.v1 + "/responses", headers=HEADERS, timeout=60, json={
        "model": "kimi-k3", "input": "And tomorrow?", "previous_response_id": rid, "max_output_tokens": 4,
        "background": True})
    assert queued.status_code == 200 and queued.json()["status"] == "queued"
    assert queued.json()["usage"] is None  # nothing to settle by: the reservation stays charged
    flush(gw)
    background = last_record(sim)
    until(lambda: background.completed, timeout=30)
    charged = used_now(gw, TPM) - before
    assert charged >= background.prompt_tokens + background.completion_tokens_sent > 2000
    # A follow-up of the background response prefills both turns; its client hangs up at once.
    with httpx.stream("POST", gw.v1 + "/responses", headers=HEADERS, timeout=60, json={
            "model": "kimi-k3", "input": "And then?", "previous_response_id": queued.json()["id"],
            "max_output_tokens": 200, "stream": True}) as response:  # 10 s of output
        assert response.status_code == 200
    until(lambda: last_record(sim) is not background and last_record(sim).finished_at is not None, timeout=30)
    engine = last_record(sim)
    assert engine.prompt_tokens > background.prompt_tokens
    until(lambda: used_now(gw, TPM) - before - charged >= engine.prompt_tokens, timeout=10)


@pytest.mark.parametrize(("engine", "ids_field"), [
    ("sglang", {"input_ids": list(range(100, 6100))}),
    ("vllm", {"kv_transfer_params": {"prompt_token_ids": list(range(100, 6100))}}),
])
def test_prompt_token_ids_an_engine_prefills_are_reserved(start_sim: StartSim, start_gateway: StartGateway,
                                                          prefix: str, engine: str,
                                                          ids_field: dict[str, Any]) -> None:
    sim = start_sim(engine)
    gw = gateway(start_gateway, sim, prefix, engine, allow_kv_transfer_fields=True)
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **ids_field}
    first = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS, timeout=60, json=body)
    assert first.status_code == 200, first.text  # served: the field is the engine's to judge
    assert first.json()["usage"]["prompt_tokens"] == 6000
    used = used_now(gw, TPM)
    assert used == 6004
    second = httpx.post(gw.v1 + "/chat/completions", headers=HEADERS, timeout=60, json=body)
    assert second.status_code == 429, second.text  # 6,004 more do not fit in the 3,996 left
    assert f"Used {used}, Requested " in second.json()["error"]["message"]
    assert used_now(gw, TPM) == used
