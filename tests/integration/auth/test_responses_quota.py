"""Responses API requests count against a key's token limit like chat: the reservation (prompt
estimate + `max_output_tokens`, else the pool's) is settled against the engine's usage
(`input_tokens` + `output_tokens`), for a JSON answer at once and for a stream when it ends."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.integration.auth.test_quota_settle_http import until, used_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


def test_responses_usage_settles_the_reservation(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", eos_after_tokens=16)  # its model ends after 16 under the limit the gateway sends
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, default_output_tokens=500)],
                       auth=auth_section({"tokens_per_minute": 1000, "requests_per_minute": 1000}),
                       affinity={"enabled": False}, load={"enabled": False})
    start_a_window_now(gw)
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    first = sdk.responses.create(model="kimi-k3", input="Hi")  # 500 reserved; the engine stops after 16
    assert first.usage is not None and first.usage.output_tokens == 16
    assert used_now(gw, 990) == first.usage.total_tokens
    stream = sdk.responses.create(model="kimi-k3", input="Hi", max_output_tokens=8, stream=True)
    final = next(e for e in stream if e.type == "response.completed").response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 8
    until(lambda: used_now(gw, 990) == first.usage.total_tokens + final.usage.total_tokens)  # type: ignore[union-attr]
