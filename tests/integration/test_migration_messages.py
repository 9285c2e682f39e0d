"""Mid-stream migration of Anthropic Messages streams (issue 23): the engines' Messages layers start a
new turn after a trailing assistant message, so the answer goes on on the engine's chat API (its
chat twin plus the text so far as the final assistant message, `continue_final_message`), and the
client reads one Anthropic event stream: `message_start` once, the text block's deltas on, one
`message_delta` with the whole answer's usage, one `message_stop` (the real anthropic SDK reads it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

BODY = {"model": "kimi-k3", "max_tokens": 24, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "tell me a long story"}]}


def events_of(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event type, data) of each Anthropic event of a stream (comments and `[DONE]` left out)."""
    with httpx.stream("POST", url, json=body, timeout=15) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_raw())
    out = []
    for event in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in event.split(b"\n") if line.startswith((b"event: ", b"data: ")))
        if b"event" in lines:
            out.append((lines[b"event"].decode(), json.loads(lines[b"data"])))
    return out


def text_of(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"].get("text", "") for kind, d in events if kind == "content_block_delta")


def setup(start_sim: StartSim, start_gateway: StartGateway, engine: str, faults: SimFaults
          ) -> tuple[RunningSim, RunningGateway]:
    bad = start_sim(engine, faults=faults)
    good = start_sim(engine)
    gw = start_gateway([pool("p", engine, [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0},
                       timeouts={"read": 0.5, "first_byte_base": 0.5, "first_byte_per_1k_tokens": 0})
    return good, gw


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", ["eof", "stall", "reset", "error"])
def test_a_messages_stream_whose_worker_fails_reads_as_one_anthropic_stream(
        start_sim: StartSim, start_gateway: StartGateway, engine: str, fault: str) -> None:
    faults = {"eof": SimFaults(drop_after_chunks=8), "stall": SimFaults(stall_after_chunks=8),
              "reset": SimFaults(reset_after_chunks=8), "error": SimFaults(error_after_chunks=8)}[fault]
    good, gw = setup(start_sim, start_gateway, engine, faults)
    reference = events_of(good.url + "/v1/messages", BODY)
    events = events_of(gw.url + "/v1/messages", BODY)
    kinds = [kind for kind, _ in events]
    assert kinds.count("message_start") == 1 and kinds.count("message_delta") == 1, kinds
    assert kinds[-1] == "message_stop" and kinds.count("message_stop") == 1 and "error" not in kinds, kinds
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1, kinds
    assert text_of(events) == text_of(reference) and len(text_of(events).split(" ")) == 24
    assert {d["index"] for kind, d in events if kind.startswith("content_block")} == {0}
    start = next(d for kind, d in events if kind == "message_start")["message"]
    assert start["id"] == next(d for kind, d in events if kind == "message_start")["message"]["id"]
    end = next(d for kind, d in events if kind == "message_delta")
    reference_end = next(d for kind, d in reference if kind == "message_delta")
    assert end["delta"]["stop_reason"] == reference_end["delta"]["stop_reason"] == "max_tokens"
    assert end["usage"]["output_tokens"] == 24
    assert end["usage"]["input_tokens"] == reference_end["usage"]["input_tokens"]  # the original prompt's
    continued = good.engine.records[-1]
    assert continued.path == "/v1/chat/completions"
    assert continued.body["continue_final_message"] is True and continued.body["add_generation_prompt"] is False
    assert continued.body["messages"][:-1] == BODY["messages"] and continued.body["temperature"] == 0
    kept = len(continued.body["messages"][-1]["content"].split(" "))
    assert continued.body["max_tokens"] == 24 - kept
    gw.wait_for_metric('kimi_gateway_migrations_total{outcome="migrated",pool="p"}', lambda v: v == 1)
    assert gw.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="p"}', lambda v: v > 0) == 24
    assert gw.metric('kimi_gateway_tokens_total{kind="prompt",pool="p"}') == reference_end["usage"]["input_tokens"]
    gw.wait_until_idle()


def test_the_anthropic_sdk_reads_one_message(start_sim: StartSim, start_gateway: StartGateway) -> None:
    good, gw = setup(start_sim, start_gateway, "vllm", SimFaults(drop_after_chunks=6))
    whole = httpx.post(good.url + "/v1/messages", json={**BODY, "stream": False}, timeout=5).json()
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    body = {k: v for k, v in BODY.items() if k not in ("stream", "temperature")}
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == whole["content"][0]["text"] == message.content[0].text  # type: ignore[union-attr]
    assert message.usage.output_tokens == 24 and message.stop_reason == "max_tokens"


def test_a_messages_stream_prefilled_by_the_client_is_not_migrated(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    good, gw = setup(start_sim, start_gateway, "vllm", SimFaults(drop_after_chunks=8))
    body = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Once"}]}
    events = events_of(gw.url + "/v1/messages", body)
    assert events[-1][0] == "error" and good.engine.records == []
    assert gw.wait_for_metric('kimi_gateway_migrations_total{outcome="refused",pool="p"}', lambda v: v == 1)
