"""Anthropic's Messages API through the gateway to real llama.cpp workers (SmolLM2-135M): streamed
and not with the anthropic SDK, count_tokens answered by the engine's tokenizer, and a Messages
turn whose prompt the engine then finds in its cache for the same conversation sent as chat."""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from gateway.llamacpp_worker import LlamaCppWorker
from tests.e2e.smollm2 import SMOLLM2_ESTIMATION
from tests.support import RunningGateway, pool

pytestmark = pytest.mark.engine


@pytest.fixture
def gateway(worker_2k: LlamaCppWorker, start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    return start_gateway([pool("cpu-2k", "llamacpp", [worker_2k.url], 2048, default_output_tokens=256)],
                         timeouts={"first_byte_base": 120.0}, estimation=SMOLLM2_ESTIMATION)


def test_messages_streamed_and_not(gateway: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(model="kimi-k3", max_tokens=8, system="Answer briefly.",
                                     messages=[{"role": "user", "content": "Name a colour."}])
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens <= 8 and message.usage.input_tokens > 5
    with client.messages.stream(model="kimi-k3", max_tokens=8, system="Answer briefly.",
                                messages=[{"role": "user", "content": "Name an animal."}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 2 and "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason in ("max_tokens", "end_turn")
    # Counted by the gateway from llama.cpp's usage (message_start's input, message_delta's output).
    expected = message.usage.output_tokens + final.usage.output_tokens
    gateway.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="cpu-2k"}', lambda n: n == expected)


def test_count_tokens_and_the_chat_twin_share_the_engines_cache(gateway: RunningGateway) -> None:
    system, question = "You are a careful assistant.", "Explain in one sentence why the sky is blue."
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)
    counted = client.messages.count_tokens(model="kimi-k3", system=system,
                                           messages=[{"role": "user", "content": question}])
    message = client.messages.create(model="kimi-k3", max_tokens=4, system=system,
                                     messages=[{"role": "user", "content": question}])
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    chat = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=120).chat.completions.create(
        model="kimi-k3", max_tokens=4, messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": question}])
    assert chat.usage is not None and chat.usage.prompt_tokens == counted.input_tokens
    details = chat.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= counted.input_tokens - 2  # the Messages turn's prompt, found in the cache


def test_a_mid_conversation_system_turn_and_another_role_reach_llamacpp(gateway: RunningGateway) -> None:
    """Claude Code 2.1's `system` turn between the others, and a role of no API's (`developer`):
    llama.cpp's server passes every role to its chat template (server_chat_convert_anthropic_to_oai),
    so the gateway forwards both and the engine answers."""
    for role in ("system", "developer"):
        answer = httpx.post(f"{gateway.url}/v1/messages?beta=true", timeout=120, json={
            "model": "kimi-k3", "max_tokens": 4, "system": [{"type": "text", "text": "Answer briefly."}],
            "messages": [{"role": "user", "content": "Name a colour."},
                         {"role": role, "content": "<system-reminder>Be brief.</system-reminder>"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"][0]["text"]
