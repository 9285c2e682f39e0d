"""A Messages answer's usage is billed as each engine reports it (issue 26 §4): vLLM puts the prompt
in `message_start` and `message_delta`, SGLang zeros in `message_start` and the whole prompt (its
cached part again as `cache_read_input_tokens`) in `message_delta`, its earlier layer everything in
`message_stop`, llama.cpp the prompt only in `message_start` (`gateway/sim/anthropic.py` has the
sources). The key is charged the engine's whole prompt + output every time: never zero, never the
cached part twice. Real gateway, real simulated engines in each mode, the real anthropic SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.integration.auth.test_quota_settle_http import until, used_now
from tests.support import RunningGateway, RunningSim, pool

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
