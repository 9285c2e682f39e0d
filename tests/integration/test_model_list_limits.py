"""What the model list tells clients of each model's limits (issue 37 §10), through a real gateway in
front of simulated vLLM workers of different contexts: every `/v1/models` entry carries the largest
context a request for it can be routed to (`max_model_len`, as vLLM's own model cards), through the
real OpenAI SDK; the real Anthropic SDK (which sends `anthropic-version`) gets Anthropic's model
list, paged, with `max_input_tokens` and `max_tokens`; both only what the caller's key may use."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime

import anthropic
import httpx
import openai
import pytest

from gateway.auth.keys import hash_key
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
ALICE_KEY = "sk-alice-" + uuid.uuid4().hex + uuid.uuid4().hex
OPS_KEY = "sk-ops-" + uuid.uuid4().hex + uuid.uuid4().hex


def gateway(start_sim: StartSim, start_gateway: StartGateway) -> RunningGateway:
    """kimi-k3 on a 32K pool then a 128K one; a small model (alias `small`) and its LoRA adapter on an
    8K pool. Alice may use the small model and its adapter only."""
    cheap, long, small = (start_sim("vllm", max_context_tokens=n) for n in (32768, 131072, 8192))
    return start_gateway(
        [pool("cheap", "vllm", [cheap.url], 32768), pool("long", "vllm", [long.url], 131072),
         pool("small", "vllm", [small.url], 8192, lora_adapters=["small-lora"])],
        models=[{"name": "kimi-k3", "aliases": ["moonshotai/Kimi-K3"], "pools": ["cheap", "long"]},
                {"name": "small-model", "aliases": ["small"], "pools": ["small"]}],
        auth={"enabled": True, "keys": [
            {"name": "alice", "sha256": hash_key(ALICE_KEY), "models": ["small", "small-lora"]},
            {"name": "ops", "sha256": hash_key(OPS_KEY)}]},
        load={"enabled": False})


CONTEXTS = {"kimi-k3": 131072, "moonshotai/Kimi-K3": 131072, "small-model": 8192, "small": 8192, "small-lora": 8192}


def test_openai_model_list_carries_each_models_context(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_sim, start_gateway)
    with openai.OpenAI(base_url=gw.v1, api_key=OPS_KEY, max_retries=0) as ops, \
            openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0) as alice:
        assert {m.id: m.model_dump()["max_model_len"] for m in ops.models.list()} == CONTEXTS
        assert {m.id: m.model_dump()["max_model_len"] for m in alice.models.list()} == {
            "small-model": 8192, "small": 8192, "small-lora": 8192}
        retrieved = ops.models.retrieve("moonshotai/Kimi-K3").model_dump()
        assert (retrieved["max_model_len"], retrieved["owned_by"]) == (131072, "moonshotai")
        assert alice.models.retrieve("small-lora").model_dump()["max_model_len"] == 8192
    # the largest context a request can be routed to is what a request may use: one that fills the
    # 128K context is served (by the long pool), one token more is refused naming that same length
    fits = httpx.post(gw.v1 + "/completions", headers={"authorization": f"Bearer {OPS_KEY}"}, timeout=30,
                      json={"model": "kimi-k3", "prompt": [7] * (131072 - 4), "max_tokens": 4})
    assert fits.status_code == 200 and fits.headers["x-kimi-gateway-pool"] == "long"
    over = httpx.post(gw.v1 + "/completions", headers={"authorization": f"Bearer {OPS_KEY}"}, timeout=30,
                      json={"model": "kimi-k3", "prompt": [7] * 131072, "max_tokens": 4})
    assert over.status_code == 400 and "maximum context length is 131072 tokens" in over.text


def test_anthropic_model_list_in_anthropics_shape(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw = gateway(start_sim, start_gateway)
    with anthropic.Anthropic(base_url=gw.url, api_key=OPS_KEY, max_retries=0) as ops, \
            anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0) as alice:
        listed = list(ops.models.list(limit=2))  # three pages of two, followed by the SDK
        assert {m.id: (m.max_input_tokens, m.max_tokens) for m in listed} == {
            name: (context, context) for name, context in CONTEXTS.items()}
        assert [m.id for m in listed] == list(CONTEXTS)  # the OpenAI list's order
        assert all(m.type == "model" and m.display_name == m.id and isinstance(m.created_at, datetime)
                   for m in listed)
        first = ops.models.list(limit=2)
        assert (first.has_more, first.first_id, first.last_id) == (True, "kimi-k3", "moonshotai/Kimi-K3")
        before = ops.models.list(before_id="small", limit=1)
        assert [m.id for m in before.data] == ["small-model"] and before.has_more
        assert [m.id for m in alice.models.list()] == ["small-model", "small", "small-lora"]
        assert alice.models.retrieve("small").max_input_tokens == 8192
        with pytest.raises(anthropic.NotFoundError) as hidden:
            alice.models.retrieve("kimi-k3")
        message = "The model `kimi-k3` does not exist or you do not have access to it."
        assert hidden.value.body == {"type": "error", "error": {"type": "not_found_error", "message": message}}
        with pytest.raises(anthropic.BadRequestError):
            ops.models.list(limit=0)
