"""A Messages answer's usage is billed as each engine reports it (issue 26 §4): vLLM 0.32 puts the
whole prompt in `message_start` and Anthropic's split (uncached `input_tokens`, `cache_read_input_tokens`,
`cache_creation_input_tokens`) in `message_delta`, SGLang zeros in `message_start` and the whole prompt (its
cached part again as `cache_read_input_tokens`) in `message_delta`, its earlier layer everything in
`message_stop`, llama.cpp the prompt only in `message_start` (`gateway/sim/anthropic.py` has the
sources). The key is charged the engine's whole prompt + output every time: never zero, never the
cached part twice. Real gateway, real simulated engines in each mode, the real anthropic SDK."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.integration.auth.test_quota_settle_http import until, used_now
from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
TPM = 100_000
PROMPT = [{"role": "user", "content": "Count the tokens of this prompt, please: " + "lorem ipsum " * 40}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("engine", "mode"), [
    ("vllm", "vllm"), ("sglang", "sglang"), ("sglang", "sglang_message_stop"), ("vllm", "llamacpp")])
def test_messages_usage_is_billed_as_the_engine_reports_it(start_sim: StartSim, start_gateway: StartGateway,
                                                           engine: str, mode: str, stream: bool) -> None:
    # A prefix cache, so the second answer's prompt is partly cached (SGLang then reports that part twice).
    sim = start_sim(engine, messages_usage=mode, kv_capacity_tokens=65536, kv_block_tokens=16)
    gw = start_gateway([pool("p", engine, [sim.url], 131072, default_output_tokens=500)],
                       auth=auth_section({"tokens_per_minute": TPM}),
                       affinity={"enabled": False}, load={"enabled": False})
    start_a_window_now(gw)
    client = anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0)
    charged = 0
    for _ in range(2):
        kwargs: dict[str, Any] = {"model": "kimi-k3", "max_tokens": 12, "messages": PROMPT}
        if stream:
            with client.messages.stream(**kwargs) as events:
                assert events.get_final_text()
        else:
            assert client.messages.create(**kwargs).content
        record = sim.engine.records[-1]
        assert record.completed and record.prompt_tokens > 0
        charged += record.prompt_tokens + record.completion_tokens_sent
        until(lambda: used_now(gw, TPM) == charged)  # noqa: B023 (checked before the next request)
    assert sim.engine.records[-1].cached_tokens > 0  # the second prompt hit the cache


def test_a_streamed_cached_vllm_answer_bills_its_prompt_once(start_sim: StartSim, start_gateway: StartGateway,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """vLLM 0.32 streams the whole prompt in `message_start`, then in `message_delta` its uncached part
    as `input_tokens` beside `cache_read_input_tokens` (`vllm/entrypoints/anthropic/serving.py`): the
    request record, `kimi_gateway_tokens_total` and the key's quota count that prompt once."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", kv_capacity_tokens=65536, kv_block_tokens=16)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, default_output_tokens=500)],
                       auth=auth_section({"tokens_per_minute": TPM}),
                       affinity={"enabled": False}, load={"enabled": False})
    start_a_window_now(gw)
    client = anthropic.Anthropic(base_url=gw.url, api_key=ALICE_KEY, max_retries=0)
    prompts, charged = 0, 0
    for n in (1, 2):
        with client.messages.stream(model="kimi-k3", max_tokens=12, messages=PROMPT) as events:
            final = events.get_final_message()
        record = sim.engine.records[-1]
        assert record.completed
        usage = final.usage  # the SDK's reading of the relayed message_delta: Anthropic's split
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) \
            == record.prompt_tokens
        assert (usage.cache_read_input_tokens or 0) == record.cached_tokens
        prompts += record.prompt_tokens
        charged += record.prompt_tokens + record.completion_tokens_sent
        logged = access_lines(caplog, gw, n)[-1]["usage"]
        assert logged["prompt_tokens"] == record.prompt_tokens
        assert logged.get("prompt_tokens_details", {}).get("cached_tokens", 0) == record.cached_tokens
        gw.wait_for_metric('kimi_gateway_tokens_total{kind="prompt",pool="p"}', lambda v: v == prompts)  # noqa: B023
        until(lambda: used_now(gw, TPM) == charged)  # noqa: B023
    assert sim.engine.records[-1].cached_tokens > 0  # the second prompt hit the cache
