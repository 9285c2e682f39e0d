"""Audio counts toward a key's token limit (issue 10 §6): the estimate that routes a request also charges it."""

from __future__ import annotations

import base64
from collections.abc import Callable

import openai
import pytest

from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.media import wav_bytes
from tests.support import RunningGateway, RunningSim, pool


def audio_chat(gw: RunningGateway, seconds: float) -> object:
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    data = base64.b64encode(wav_bytes(seconds)).decode()
    return sdk.chat.completions.create(model="kimi-k3", max_tokens=10, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}])


def test_audio_is_charged_to_the_token_limit(start_sim: Callable[..., RunningSim],
                                             start_gateway: Callable[..., RunningGateway]) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, modalities=["text", "audio"])],
                       auth=auth_section({"tokens_per_minute": 3000}), load={"enabled": False},
                       affinity={"enabled": False})
    start_a_window_now(gw)  # the in-process limiter: its minute starts now, clear of any edge
    # A text request leaves ~1,000 tokens of the minute's 3,000 (its charge settles at what it used).
    sdk = openai.OpenAI(base_url=gw.v1, api_key=ALICE_KEY, max_retries=0)
    sdk.chat.completions.create(model="kimi-k3", max_tokens=2000, messages=[{"role": "user", "content": "Hi"}])
    # A minute of audio is 1,500 tokens + 40 of chat template + 10 of output: it no longer fits.
    with pytest.raises(openai.RateLimitError) as info:
        audio_chat(gw, 60.0)
    assert "Limit 3000" in info.value.message and "Requested 1550" in info.value.message
    # Four minutes of audio alone is over the whole limit (it was 43 tokens by its bytes).
    with pytest.raises(openai.RateLimitError) as too_large:
        audio_chat(gw, 240.0)
    assert "Request too large" in too_large.value.message and "Requested 6050" in too_large.value.message
    assert len(sim.engine.records) == 1
