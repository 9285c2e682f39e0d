"""An integral float output limit (`max_tokens: 5.0`) end to end: real `openai` / `anthropic` SDKs →
gateway → simulated vLLM and SGLang engines.

JSON has one number type, and the engines' pydantic models (`int` fields in lax mode) read 5.0 as 5
and refuse 5.5. The gateway does the same (`protocol.openai.WHOLE`): it reserves and routes by 5
tokens and forwards the client's body unchanged (5.0 stays 5.0 on the wire, which the engines
accept); 5.5 it refuses itself, naming the parameter, so no engine sees it.
"""

from __future__ import annotations

from collections.abc import Callable

import anthropic
import openai
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HELLO = [{"role": "user", "content": "Say hello."}]
SMALL, LARGE = 2000, 8000  # pool contexts, tokens


@pytest.fixture
def two_pools(start_sim: StartSim, start_gateway: StartGateway) -> tuple[RunningGateway, dict[str, RunningSim]]:
    sims = {"vllm-small": start_sim("vllm", max_context_tokens=SMALL),
            "sglang-large": start_sim("sglang", max_context_tokens=LARGE)}
    gw = start_gateway([pool("vllm-small", "vllm", [sims["vllm-small"].url], SMALL),
                        pool("sglang-large", "sglang", [sims["sglang-large"].url], LARGE)],
                       affinity={"enabled": False})
    return gw, sims


def _openai(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


def _anthropic(gw: RunningGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)


def test_chat_max_tokens_5_0_is_5_tokens_forwarded_unchanged(
        two_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = two_pools
    raw = _openai(gw).chat.completions.with_raw_response.create(
        model="kimi-k3", messages=HELLO, max_tokens=5.0, n=1.0)  # type: ignore[arg-type]
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"
    sent = sims[raw.headers["x-kimi-gateway-pool"]].engine.records[-1].body
    assert type(sent["max_tokens"]) is float and sent["max_tokens"] == 5.0, "forwarded as the client sent it"
    newer = _openai(gw).chat.completions.create(model="kimi-k3", messages=HELLO,
                                                max_completion_tokens=3.0)  # type: ignore[arg-type]
    assert newer.usage is not None and newer.usage.completion_tokens == 3
    text = _openai(gw).completions.create(model="kimi-k3", prompt="Once upon", max_tokens=4.0)  # type: ignore[arg-type]
    assert text.usage is not None and text.usage.completion_tokens == 4


def test_messages_max_tokens_5_0_is_5_tokens(two_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = two_pools
    raw = _anthropic(gw).messages.with_raw_response.create(model="kimi-k3", max_tokens=5.0,  # type: ignore[arg-type]
                                                           messages=HELLO)  # type: ignore[arg-type]
    message = raw.parse()
    assert message.usage.output_tokens == 5 and message.stop_reason == "max_tokens"
    record = sims[raw.headers["x-kimi-gateway-pool"]].engine.records[-1]
    assert record.path == "/v1/messages" and record.body["max_tokens"] == 5.0


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_the_reservation_reads_an_integral_float_as_its_integer(
        two_pools: tuple[RunningGateway, dict[str, RunningSim]], api: str) -> None:
    """Prompt + max_tokens == the small pool's context fits it; one token more (as a float too)
    goes to the large pool: the estimate counted 5.0-style limits as whole tokens."""
    gw, sims = two_pools

    def routed(max_tokens: float) -> tuple[str, int]:
        if api == "chat":
            raw = _openai(gw).chat.completions.with_raw_response.create(
                model="kimi-k3", messages=HELLO, max_tokens=max_tokens)  # type: ignore[arg-type]
        else:
            raw = _anthropic(gw).messages.with_raw_response.create(
                model="kimi-k3", max_tokens=max_tokens, messages=HELLO)  # type: ignore[arg-type]
        estimate = int(raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
        return raw.headers["x-kimi-gateway-pool"], estimate

    _, prompt = routed(1.0)
    assert routed(float(SMALL - prompt)) == ("vllm-small", prompt)
    assert routed(float(SMALL - prompt + 1)) == ("sglang-large", prompt)
    assert len(sims["vllm-small"].engine.records) + len(sims["sglang-large"].engine.records) == 3


def test_a_fractional_limit_is_refused_by_the_gateway_naming_it(
        two_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = two_pools
    with pytest.raises(openai.BadRequestError) as chat:
        _openai(gw).chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=5.5)  # type: ignore[arg-type]
    assert chat.value.param == "max_tokens"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as n:
        _openai(gw).chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=2, n=1.5)  # type: ignore[arg-type]
    assert n.value.param == "n"  # type: ignore[attr-defined]
    with pytest.raises(anthropic.BadRequestError) as messages:
        _anthropic(gw).messages.create(model="kimi-k3", max_tokens=5.5, messages=HELLO)  # type: ignore[arg-type]
    assert messages.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in messages.value.body["error"]["message"]  # type: ignore[index]
    assert "Field required" not in messages.value.body["error"]["message"]  # type: ignore[index]
    assert all(not sim.engine.records for sim in sims.values()), "the gateway refused them itself"



def test_responses_max_output_tokens_5_0_is_5_tokens(two_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    """The gateway reads `max_output_tokens: 5.0` as 5 and forwards it; the engines' `ResponsesRequest`
    (`max_output_tokens: int | None`, lax) does too, so the answer has 5 output tokens, not a 400."""
    gw, sims = two_pools
    raw = _openai(gw).responses.with_raw_response.create(model="kimi-k3", input="Say hello.",
                                                        max_output_tokens=5.0)  # type: ignore[arg-type]
    response = raw.parse()
    assert response.usage is not None and response.usage.output_tokens == 5
    sent = sims[raw.headers["x-kimi-gateway-pool"]].engine.records[-1].body
    assert type(sent["max_output_tokens"]) is float, "forwarded as the client sent it"
