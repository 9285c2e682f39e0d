"""The real `openai` SDK reads the simulator's responses (streaming and not) and its errors."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from gateway.sim.tokens import output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

HELLO = [{"role": "user", "content": "hello world"}]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "ascend"])
def test_sdk_chat_non_streaming_and_streaming(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine=engine)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    done = client.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=5)  # type: ignore[arg-type]
    assert done.choices[0].message.content == output_text(5)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.prompt_tokens == 7 and done.usage.completion_tokens == 5

    stream = client.chat.completions.create(model="kimi-k3", messages=HELLO, max_tokens=6,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == output_text(6)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 13
    client.close()


def test_sdk_text_completions_and_models(start_sim: StartSim) -> None:
    srv = start_sim()
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.completions.create(model="kimi-k3", prompt="Say hi", max_tokens=3)
        assert done.choices[0].text == output_text(3)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="kimi-k3", prompt="Say hi", max_tokens=3, stream=True))
        assert streamed == output_text(3)
        assert [m.id for m in client.models.list()] == ["kimi-k3"]


def test_sdk_sees_errors(start_sim: StartSim) -> None:
    srv = start_sim(max_context_tokens=50)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length is 50 tokens") as info:
            client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "x" * 400}],
                                           stream=True)
        assert info.value.status_code == 400
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=HELLO)  # type: ignore[arg-type]
