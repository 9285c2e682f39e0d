"""A typed stream's last event is known by its type, not by the bytes an engine happened to write.

Engines and the proxies in front of them do not all write compact JSON: Python's `json.dumps`
writes `"type": "response.completed"` (a space after each colon), an SSE `event:` field may have no
space after its colon (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation)
and lines may end in CRLF. A complete stream written that way must reach the client exactly as sent,
with no error event of the gateway's appended, and count as a 2xx; the openai SDK reads the Responses
events by their JSON `type` (openai/_streaming.py), the anthropic SDK by the `event:` line."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

RESPONSE = {"id": "resp_spaced1", "object": "response", "created_at": 1, "model": "kimi-k3", "status": "in_progress",
            "output": [], "error": None, "incomplete_details": None, "parallel_tool_calls": True, "tools": [],
            "tool_choice": "auto"}
USAGE = {"input_tokens": 4, "output_tokens": 1, "total_tokens": 5,
         "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def spaced(event: dict[str, object], named: bool, newline: str = "\n") -> bytes:
    """One Responses/Messages SSE event with `json.dumps`'s default spacing; `named`: with an `event:` line."""
    head = f"event: {event['type']}{newline}" if named else ""
    return f"{head}data: {json.dumps(event)}{newline}{newline}".encode()


def responses_stream(named: bool, last: dict[str, object]) -> list[bytes]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}]}
    return [
        spaced({"type": "response.created", "sequence_number": 0, "response": RESPONSE}, named),
        spaced({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1", "output_index": 0,
                "content_index": 0, "delta": "hi"}, named),
        spaced({"sequence_number": 2, **last,
                "response": {**RESPONSE, "status": last["type"].split(".")[1], "output": [item],  # type: ignore[union-attr]
                             "usage": USAGE}}, named),
    ]


def relay(gw: RunningGateway, path: str, body: dict[str, object]) -> bytes:
    with httpx.stream("POST", gw.v1 + path, json=body) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def scripted(start_sim: StartSim, start_gateway: StartGateway, chunks: list[bytes]) -> RunningGateway:
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)))
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})


@pytest.mark.parametrize("named", [True, False], ids=["event-lines", "data-only"])
@pytest.mark.parametrize("end", ["response.completed", "response.incomplete", "response.failed"])
def test_a_spaced_responses_stream_ends_at_its_terminal_event(start_sim: StartSim, start_gateway: StartGateway,
                                                              named: bool, end: str) -> None:
    chunks = responses_stream(named, {"type": end})
    gw = scripted(start_sim, start_gateway, chunks)
    body = {"model": "kimi-k3", "input": "hi", "stream": True}
    assert relay(gw, "/responses", body) == b"".join(chunks)  # nothing appended: the end event was seen
    gw.wait_for_metric('kimi_gateway_requests_total{api="responses",pool="p",status_class="2xx"}', lambda n: n == 1)
    gw.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="p"}', lambda n: n == 1)  # usage read too
    events = list(openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).responses.create(
        model="kimi-k3", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.output_text.delta", end]


def test_an_engines_spaced_error_event_gets_no_second_one(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A Responses stream that the engine ends with its own error event, spaced and without an
    `event:` line (the openai SDK reads its JSON `type`): passed on as it is, no gateway error after it."""
    chunks = responses_stream(False, {"type": "response.completed"})[:2]
    chunks.append(spaced({"type": "error", "code": "server_error", "message": "engine died", "param": None,
                          "sequence_number": 2}, False))
    gw = scripted(start_sim, start_gateway, chunks)
    assert relay(gw, "/responses", {"model": "kimi-k3", "input": "hi", "stream": True}) == b"".join(chunks)


def test_a_messages_stream_with_unspaced_event_lines_and_crlf_ends_at_message_stop(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    def event(data: dict[str, object]) -> bytes:
        return f"event:{data['type']}\r\ndata: {json.dumps(data)}\r\n\r\n".encode()

    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "kimi-k3", "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    chunks = [
        event({"type": "message_start", "message": message}),
        event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
        event({"type": "content_block_stop", "index": 0}),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": 1}}),
        event({"type": "message_stop"}),
    ]
    gw = scripted(start_sim, start_gateway, chunks)
    body = {"model": "kimi-k3", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert relay(gw, "/messages", body) == b"".join(chunks)
    gw.wait_for_metric('kimi_gateway_requests_total{api="messages",pool="p",status_class="2xx"}', lambda n: n == 1)
