"""Content parts the engines accept reach them (issue 10 §6): part types the gateway does not model
are forwarded unchanged, image data URIs in every form the engines read are measured, and audio and
video are counted into the estimate that routes the request."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.media import wav_bytes
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


def post(gw: RunningGateway, parts: list[dict[str, Any]], **body: Any) -> httpx.Response:
    payload = {"model": "kimi-k3", "max_tokens": 4, "messages": [{"role": "user", "content": parts}], **body}
    return httpx.post(gw.v1 + "/chat/completions", content=json.dumps(payload), timeout=60,
                      headers={"content-type": "application/json"})


def estimate(response: httpx.Response) -> tuple[int, str]:
    tokens, method = response.headers["x-kimi-gateway-estimated-prompt-tokens"].split("; method=")
    return int(tokens), method


@pytest.fixture
def two_pools(start_sim: StartSim, start_gateway: StartGateway) -> tuple[RunningGateway, RunningSim, RunningSim]:
    small, large = start_sim("vllm", max_context_tokens=4096), start_sim("sglang", max_context_tokens=131072)
    modalities = ["text", "image", "audio", "video"]
    gw = start_gateway([pool("small", "vllm", [small.url], 4096, modalities=modalities, default_output_tokens=256),
                        pool("large", "sglang", [large.url], 131072, modalities=modalities)],
                       estimation={"video_tokens_default": 9000})
    return gw, small, large


def test_unmodelled_part_types_are_forwarded_unchanged(
        two_pools: tuple[RunningGateway, RunningSim, RunningSim]) -> None:
    gw, small, _ = two_pools
    parts: list[dict[str, Any]] = [
        {"type": "text", "text": "What is in these?"},
        {"type": "audio_url", "audio_url": {"url": "https://host/a.wav"}},
        {"type": "image_embeds", "image_embeds": "AAAA", "image_grid_thw": [1, 2, 2]},
        {"type": "some_future_part", "some_future_part": {"x": [1, None]}},
    ]
    response = post(gw, parts)
    assert response.status_code == 200, response.text
    assert small.engine.records[-1].body["messages"][0]["content"] == parts
    tokens, method = estimate(response)
    assert method == "bytes+audio_default" and tokens >= 750


def test_modality_check_uses_what_the_pool_declares(start_sim: StartSim, start_gateway: StartGateway) -> None:
    text_sim, audio_sim = start_sim("vllm"), start_sim("vllm")
    gw = start_gateway([pool("text", "vllm", [text_sim.url], 131072, modalities=["text"]),
                        pool("audio", "vllm", [audio_sim.url], 131072, modalities=["text", "audio"])])
    for part in ({"type": "audio_url", "audio_url": {"url": "https://host/a.mp3"}},
                 {"type": "audio_embeds", "audio_embeds": "AAAA"}):
        response = post(gw, [part])
        assert (response.status_code, response.headers["x-kimi-gateway-pool"]) == (200, "audio"), response.text
    # An image part needs a pool that declares images: none here.
    refused = post(gw, [{"type": "image_embeds", "image_embeds": "AAAA"}])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_content_type"
    # A part type no table knows needs nothing beyond text: the engine decides.
    assert post(gw, [{"type": "mystery", "mystery": 1}]).headers["x-kimi-gateway-pool"] == "text"
    assert not any("image_embeds" in json.dumps(r.body) for r in text_sim.engine.records + audio_sim.engine.records)


def test_image_data_uris_the_engines_read_are_measured(
        two_pools: tuple[RunningGateway, RunningSim, RunningSim], shared_data: Path) -> None:
    gw, small, _ = two_pools
    png = (shared_data / "images" / "text_448x172.png").read_bytes()
    plain = base64.b64encode(png).decode()
    uris = [f"data:application/octet-stream;base64,{plain}",
            "data:image/png;base64," + "\n".join(plain[i:i + 76] for i in range(0, len(plain), 76)),
            "data:image/png;base64," + base64.urlsafe_b64encode(png).decode()]
    one_image = None
    for uri in uris:
        response = post(gw, [{"type": "image_url", "image_url": {"url": uri}}])
        assert response.status_code == 200, response.text
        tokens, method = estimate(response)
        assert method == "bytes+pixels"
        one_image = one_image or tokens
        assert tokens == one_image  # 16 x 7 tiles of 28 px, the same image each time
        assert small.engine.records[-1].body["messages"][0]["content"][0]["image_url"]["url"] == uri


def test_input_audio_is_counted_from_its_duration_and_routed_by_it(
        two_pools: tuple[RunningGateway, RunningSim, RunningSim]) -> None:
    """The issue's example: ~11 MB of base64 WAV (250 s at 16 kHz) was 43 tokens and went to the small pool."""
    gw, _, large = two_pools
    data = base64.b64encode(wav_bytes(250.0)).decode()
    response = post(gw, [{"type": "text", "text": "Transcribe this."},
                         {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}])
    assert response.status_code == 200, response.text
    tokens, method = estimate(response)
    assert method == "bytes+audio" and 250 * 25 < tokens < 250 * 25 + 100
    assert response.headers["x-kimi-gateway-pool"] == "large"
    assert large.engine.records[-1].body["messages"][0]["content"][1]["input_audio"]["data"] == data


def test_short_audio_clip_and_video_parts(two_pools: tuple[RunningGateway, RunningSim, RunningSim]) -> None:
    gw, _, _ = two_pools
    clip = "data:audio/wav;base64," + base64.b64encode(wav_bytes(4.0, rate=22050)).decode()
    response = post(gw, [{"type": "audio_url", "audio_url": {"url": clip}}])
    tokens, method = estimate(response)
    assert (response.headers["x-kimi-gateway-pool"], method) == ("small", "bytes+audio") and 100 < tokens < 200
    video = post(gw, [{"type": "video_url", "video_url": {"url": "https://host/v.mp4"}}])
    tokens, method = estimate(video)
    assert (video.headers["x-kimi-gateway-pool"], method) == ("large", "bytes+video") and tokens >= 9000
