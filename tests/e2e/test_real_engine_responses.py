"""The Responses API through the gateway to a real llama.cpp worker (SmolLM2-135M), which serves
`/v1/responses` statelessly: the openai SDK's `responses.create`, streamed and not, gets real
tokens; a `previous_response_id` follow-up is refused by the gateway itself (llama.cpp stores
nothing, so the gateway records no owner), without reaching the engine."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from gateway.llamacpp_worker import LlamaCppWorker
from tests.support import RunningGateway, pool

pytestmark = pytest.mark.engine


@pytest.fixture
def gateway(worker_2k: LlamaCppWorker, start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    return start_gateway([pool("cpu", "llamacpp", [worker_2k.url], 2048, default_output_tokens=64)],
                         timeouts={"first_byte_base": 120.0})


def test_stateless_response_streamed_and_not(gateway: RunningGateway) -> None:
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=120)
    raw = client.responses.with_raw_response.create(model="kimi-k3", input="Say hello.", instructions="Be brief.",
                                                    max_output_tokens=8)
    response = raw.parse()
    assert raw.headers["x-kimi-gateway-pool"] == "cpu" and raw.headers["x-kimi-gateway-attempts"] == "1"
    assert response.status == "completed" and response.output_text.strip()
    assert response.usage is not None and 0 < response.usage.output_tokens <= 8 and response.usage.input_tokens > 5

    events = list(client.responses.create(model="kimi-k3", input="Count to five.", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2, "tokens arrive as separate events"
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text
    # An end-of-generation token is counted in usage but sends no delta (seen: 3 tokens, 2 deltas).
    assert final.usage is not None and len(deltas) <= final.usage.output_tokens <= len(deltas) + 1
    # The relay saw the stream complete and counted the engine's usage.
    counted = response.usage.output_tokens + final.usage.output_tokens
    gateway.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="cpu"}', lambda n: n == counted)

    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model="kimi-k3", input="And then?", previous_response_id=final.id,
                                max_output_tokens=4)
    assert refused.value.body["code"] == "response_not_found"  # type: ignore[index]
