"""Heartbeats in long silences inside a stream (gateway/api/heartbeat.py): a simulated engine pauses
between two events (`pause_after_chunks`); the client gets its API's heartbeat every
`timeouts.keepalive_interval` meanwhile, only between whole events, and the real OpenAI and
Anthropic SDKs read the same answer as without the pause. Usage and the access log are unchanged."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

INTERVAL_S = 0.3
PAUSE_S = 2.5  # at least a few intervals, however loaded the box (only a lower bound is asserted)
PAUSE = {"x_sim_faults": {"pause_after_chunks": 3, "pause_s": PAUSE_S}}
COMMENT = b": keep-alive\n\n"
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
MESSAGES = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}


@pytest.fixture
def gateway(start_sim: StartSim, start_gateway: StartGateway) -> RunningGateway:
    sim = start_sim("vllm", tpot_s=0.01)
    return start_gateway([pool("p", "vllm", [sim.url], 131072)],
                         timeouts={"keepalive_interval": INTERVAL_S, "read": 60.0})


def raw_stream(gw: RunningGateway, path: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", gw.v1 + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_raw())


def events(raw: bytes) -> list[bytes]:
    """The stream's events (each without its blank line)."""
    return [event for event in raw.split(b"\n\n") if event]


def test_a_paused_chat_stream_gets_comments_between_whole_events(gateway: RunningGateway) -> None:
    raw = raw_stream(gateway, "/chat/completions", {**CHAT, **PAUSE})
    beats = raw.count(COMMENT)
    assert beats >= 2, raw  # the pause lasts several intervals; a loaded box may send fewer than PAUSE/INTERVAL
    parts = events(raw)
    assert all(part == b": keep-alive" or part.startswith(b"data: ") for part in parts), parts
    first_beat = parts.index(b": keep-alive")
    assert first_beat >= 3 and all(p.startswith(b"data: ") for p in parts[:first_beat])  # after the 3rd event
    assert parts[-1] == b"data: [DONE]"
    without = raw.replace(COMMENT, b"")
    assert without.count(b"data: ") == len(events(without))  # every other byte is a whole engine event


def test_the_openai_sdk_reads_the_same_answer_through_the_heartbeats(
        gateway: RunningGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60)
    answers = []
    for extra in ({}, PAUSE):
        started = time.monotonic()
        stream = client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True},
                                                extra_body=extra)
        chunks = list(stream)
        answers.append(("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                        chunks[-1].usage, time.monotonic() - started))
    (plain, plain_usage, _), (paused, paused_usage, took) = answers
    assert took >= PAUSE_S and paused == plain and len(plain.split()) == 8
    assert paused_usage is not None and plain_usage is not None
    assert paused_usage.completion_tokens == plain_usage.completion_tokens == 8
    # The Responses API through the SDK: typed events, comments skipped.
    events_seen = [e.type for e in client.responses.create(model="kimi-k3", input="hi", max_output_tokens=8,
                                                            stream=True, extra_body=PAUSE)]
    assert events_seen[0] == "response.created" and events_seen[-1] == "response.completed"
    logged = access_lines(caplog, gateway, 3)
    assert [line["usage"]["completion_tokens"] for line in logged[:2]] == [8, 8]
    assert all(line["outcome"] == "ok" for line in logged)


def test_a_paused_messages_stream_gets_anthropic_pings_and_the_sdk_reads_it(gateway: RunningGateway) -> None:
    raw = raw_stream(gateway, "/messages", {**MESSAGES, **PAUSE})
    assert raw.count(PING) >= 2 and COMMENT not in raw.split(b"event: content_block_start")[1], raw
    for match in re.finditer(re.escape(PING), raw):  # each ping starts where an event ended
        assert match.start() == 0 or raw[:match.start()].endswith(b"\n\n")
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60)
    texts = []
    for extra in ({}, PAUSE):
        with client.messages.stream(model="kimi-k3", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                    extra_body=extra) as stream:
            message = stream.get_final_message()
        texts.append((message.content[0].text, message.usage.output_tokens, message.stop_reason))  # type: ignore[union-attr]
    assert texts[0] == texts[1] and texts[0][1] == 8


def test_no_heartbeat_when_off(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.01)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], timeouts={"keepalive_interval": None, "read": 60.0})
    raw = raw_stream(gw, "/chat/completions", {**CHAT, "x_sim_faults": {"pause_after_chunks": 3, "pause_s": 1.0}})
    assert COMMENT not in raw and raw.endswith(b"data: [DONE]\n\n")
