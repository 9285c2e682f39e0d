"""Hostile and careless clients of the Anthropic Messages and OpenAI Responses endpoints.

One gateway and two simulated vLLM engines for the module (as `test_chat_completions_any_input.py`
does for chat). Every answer on `/v1/messages*` must be a 200 from the engine or an error in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}, "request_id"}`, the type the
status stands for); on `/v1/responses` a 200 or exactly an OpenAI error object; never a 5xx for a
client's mistake, never a hang, and no engine request left open (in-flight gauge back to 0).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import parse_config
from gateway.protocol.anthropic import error_type
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig, SimFaults
from tests.integration.test_chat_completions_any_input import (
    PROPERTY_SETTINGS,
    assert_openai_error_body,
    dump_style,
    dumps,
    json_values,
    replace_at,
    safe_text,
)
from tests.support import GatewayProcess, RunningGateway, RunningSim, pool

MAX_CONTEXT = 8192
TIMEOUT = httpx.Timeout(10.0)
CHECK_EVERY = 10
FEWER = settings(PROPERTY_SETTINGS, max_examples=100)
PNG_1X1 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
NORMAL_MESSAGES: dict[str, Any] = {"model": "kimi-k3", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
NORMAL_RESPONSES: dict[str, Any] = {"model": "kimi-k3", "input": "hi", "max_output_tokens": 2, "store": False}


class Target:
    """The module's gateway, its engines, an httpx client to it, and a counter of examples sent."""

    def __init__(self, url: str, sims: list[ThreadedServer]) -> None:
        self.url = url
        self.sims = sims
        self.client = httpx.Client(base_url=url, timeout=TIMEOUT)
        self.sent = 0
        self.answers: dict[tuple[str, int], int] = {}  # (path, status // 100) -> examples


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    sims = [ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=MAX_CONTEXT))).start()
            for _ in range(2)]
    config = parse_config({"pools": [pool("p", "vllm", [s.url for s in sims], MAX_CONTEXT, default_output_tokens=16)],
                           "health": {"interval": 0.5, "timeout": 1.0, "verify_models": False}}, environ={})
    gateway = ThreadedServer(create_app(config)).start()
    t = Target(gateway.url, sims)
    try:
        yield t
    finally:
        t.client.close()
        servers = [gateway, *sims]
        for server in servers:
            server.server.should_exit = True
        for server in servers:
            server.stop()


def assert_anthropic_error_body(response: httpx.Response) -> None:
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    data = response.json()
    assert isinstance(data, dict) and set(data) == {"type", "error", "request_id"}, data
    assert data["type"] == "error" and data["request_id"] == response.headers["request-id"], data
    error = data["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, error
    assert error["type"] == error_type(response.status_code), (response.status_code, error)
    assert isinstance(error["message"], str) and error["message"], error


def check_answer(t: Target, path: str, content: bytes, headers: dict[str, Any] | None = None) -> httpx.Response:
    """Send one body and check the property; every CHECK_EVERY examples, that normal requests work."""
    all_headers: dict[str, Any] = {"content-type": "application/json", **(headers or {})}
    with t.client.stream("POST", path, content=content, headers=all_headers) as response:
        response.read()
    assert response.status_code < 500, (response.status_code, response.text[:2000], content[:2000])
    anthropic = path.startswith("/v1/messages")
    if response.status_code == 200:
        assert response.headers.get("x-kimi-gateway-worker") in ("p/0", "p/1"), response.headers
        if response.headers["content-type"].startswith("text/event-stream"):
            last = b"event: message_stop" if anthropic else b"event: response.completed"
            assert last in response.content, response.content[-500:]
        elif path.endswith("count_tokens"):
            assert isinstance(response.json()["input_tokens"], int)
        else:
            assert response.json()["object" if not anthropic else "type"] in ("message", "response")
    elif anthropic:
        assert_anthropic_error_body(response)
    else:
        assert_openai_error_body(response)
    t.sent += 1
    key = (path, response.status_code // 100)
    t.answers[key] = t.answers.get(key, 0) + 1
    if t.sent % CHECK_EVERY == 0:
        assert_still_serving(t)
    return response


def assert_still_serving(t: Target) -> None:
    response = t.client.post("/v1/messages", json=NORMAL_MESSAGES)
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 2, response.text
    response = t.client.post("/v1/responses", json=NORMAL_RESPONSES)
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] == 2, response.text


def in_flight(t: Target) -> float:
    lines = t.client.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("kimi_gateway_in_flight{"))


# --- bodies -------------------------------------------------------------------------------------


def valid_messages() -> dict[str, Any]:
    """A Messages request using every block type the gateway models, and one it does not."""
    return {
        "model": "kimi-k3", "max_tokens": 2, "stream": False, "temperature": 0.5,
        "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "Run", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 16},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Look."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a.txt"}]},
                {"type": "text", "text": "And?"}]},
        ],
    }


MESSAGES_FIELDS = [
    "model", "max_tokens", "stream", "system", "system.0", "system.0.text", "system.0.type", "messages",
    "messages.0", "messages.0.role", "messages.0.content", "messages.0.content.0", "messages.0.content.0.type",
    "messages.0.content.0.text", "messages.0.content.1.source", "messages.0.content.1.source.type",
    "messages.0.content.1.source.data", "messages.0.content.1.source.media_type", "messages.0.content.2.source.url",
    "messages.0.content.3", "messages.1.content", "messages.1.content.0.thinking", "messages.1.content.1.input",
    "messages.1.content.1.id", "messages.1.content.1.name", "messages.2.content.0.content",
    "messages.2.content.0.content.0", "messages.2.content.0.tool_use_id", "messages.2.content.0.is_error",
    "tools", "tools.0", "tools.0.name", "tools.0.input_schema", "metadata", "metadata.user_id", "thinking",
    "temperature",
]


def valid_responses() -> dict[str, Any]:
    return {
        "model": "kimi-k3", "max_output_tokens": 2, "stream": False, "store": False, "user": "u",
        "instructions": "Be terse.", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Look."},
                                         {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_1X1}"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    }


RESPONSES_FIELDS = [
    "model", "input", "input.0", "input.0.role", "input.0.type", "input.0.content", "input.0.content.0",
    "input.0.content.0.type", "input.0.content.0.text", "input.0.content.1.image_url", "input.0.content.1",
    "input.1", "input.1.arguments", "input.1.name", "input.2.output", "instructions", "max_output_tokens",
    "previous_response_id", "store", "background", "stream", "tools", "tools.0", "user", "temperature",
]

block_types = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                               "document", "search_result", "bogus", ""])
sources = st.fixed_dictionaries(
    {"type": st.sampled_from(["base64", "url", "file", "text"]) | json_values},
    optional={"media_type": st.sampled_from(["image/png", "", "image/png;x,y"]) | json_values,
              "data": st.sampled_from([PNG_1X1, "", "@@@", "aGk="]) | json_values,
              "url": st.sampled_from(["https://example.com/a.png", "", "data:image/png;base64,@@@",
                                      "http://127.0.0.1:1/x.png"]) | json_values})
blocks = st.recursive(
    st.fixed_dictionaries({"type": block_types}, optional={
        "text": safe_text | json_values, "thinking": safe_text | json_values, "source": sources | json_values,
        "id": safe_text, "name": safe_text, "input": st.dictionaries(safe_text, json_values, max_size=3) | json_values,
        "tool_use_id": safe_text | json_values, "data": safe_text}),
    lambda inner: st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": safe_text,
                                         "content": st.lists(inner, max_size=3) | safe_text}),
    max_leaves=8)


# --- properties ---------------------------------------------------------------------------------


@FEWER
@given(field=st.sampled_from(MESSAGES_FIELDS), value=json_values, stream=st.booleans(), style=dump_style,
       path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_messages_with_one_field_replaced_by_anything(target: Target, field: str, value: Any, stream: bool,
                                                      style: str, path: str) -> None:
    body = replace_at({**valid_messages(), "stream": stream}, field, value)
    check_answer(target, path, dumps(body, style))


@FEWER
@given(content=st.lists(blocks, max_size=5) | safe_text, role=st.sampled_from(["user", "assistant", "system", ""]),
       stream=st.booleans(), path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_messages_with_random_content_blocks(target: Target, content: Any, role: str, stream: bool,
                                             path: str) -> None:
    body = {"model": "kimi-k3", "max_tokens": 2, "stream": stream, "messages": [{"role": role, "content": content}]}
    check_answer(target, path, dumps(body, "utf8"))


@FEWER
@given(field=st.sampled_from(RESPONSES_FIELDS), value=json_values, stream=st.booleans(), style=dump_style)
def test_responses_with_one_field_replaced_by_anything(target: Target, field: str, value: Any, stream: bool,
                                                       style: str) -> None:
    body = replace_at({**valid_responses(), "stream": stream}, field, value)
    check_answer(target, "/v1/responses", dumps(body, style))


@FEWER
@given(data=st.binary(max_size=300) | st.builds(lambda b: b'{"model": "kimi-k3", "max_tokens": 2, "messages": "' + b
                                                 + b'", "input": "' + b + b'"}', st.binary(max_size=60)),
       path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]))
def test_random_bytes_and_invalid_utf8(target: Target, data: bytes, path: str) -> None:
    check_answer(target, path, data)


def test_no_engine_request_left_open(target: Target) -> None:
    """Runs after the properties (file order): every lease they took is back; and the properties
    reached the engines as well as the gateway's checks (they did not only test refusals)."""
    assert_still_serving(target)
    assert in_flight(target) == 0
    if target.sent >= 300:  # the properties ran (not a -k selection)
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
            assert target.answers.get((path, 2), 0) >= 10 and target.answers.get((path, 4), 0) >= 10, target.answers
    assert all(r.finished_at is not None for s in target.sims for r in s.app.engine.records)  # type: ignore[attr-defined]


def test_a_turn_of_unmodelled_blocks_only_is_forwarded(target: Target) -> None:
    """A user turn holding only a block type the gateway does not model is a legal Messages request,
    never refused for an empty conversation the gateway made up: a PDF `document` reaches the engine
    as sent (vLLM refuses the type: its 400, in Anthropic's shape), a `search_result` reaches it as
    the text SGLang renders it as (`portable_blocks`), which every engine reads."""
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    search = {"type": "search_result", "source": "s", "title": "t", "content": [{"type": "text", "text": "x"}]}
    as_text = {"type": "text", "text": "Title: t\nSource: s\nContent: x"}
    for content, status, sent_content in (([document], 400, [document]), ([search], 200, [as_text])):
        body = {"model": "kimi-k3", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            payload = body if path == "/v1/messages" else {k: v for k, v in body.items() if k != "max_tokens"}
            response = check_answer(target, path, json.dumps(payload).encode())
            assert response.status_code == status, response.text
            sent = [r for s in target.sims for r in s.app.engine.records if r.path == path]  # type: ignore[attr-defined]
            last = max(sent, key=lambda r: r.received_at)
            assert last.body["messages"] == [{"role": "user", "content": sent_content}]


# --- engines that fail mid-stream (their own sims and gateways) -----------------------------------

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
RESPONSE_START = [
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","object":"response",'
    b'"status":"in_progress","output":[]},"sequence_number":0}\n\n',
    b'event: response.output_item.added\ndata: {"type":"response.output_item.added","output_index":0,"item":'
    b'{"id":"m1","type":"message","role":"assistant","status":"in_progress","content":[]},"sequence_number":1}\n\n',
    b'event: response.content_part.added\ndata: {"type":"response.content_part.added","item_id":"m1",'
    b'"output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]},'
    b'"sequence_number":2}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":"m1",'
    b'"output_index":0,"content_index":0,"delta":"Hi","logprobs":[],"sequence_number":3}\n\n',
]
RESPONSE_ERROR = (b'event: error\ndata: {"type":"error","code":"server_error","message":"engine broke",'
                  b'"param":null,"sequence_number":4}\n\n')
MESSAGE_START = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
    b'"assistant","content":[],"model":"kimi-k3","stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":3,"output_tokens":0}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n',
]
MESSAGE_ERROR = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"engine busy"}}\n\n'


def raw_gateway(start_sim: StartSim, start_gateway: StartGateway, chunks: list[bytes]) -> RunningGateway:
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)))
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})


def events_of(body: bytes) -> list[bytes]:
    return [event for event in body.split(b"\n\n") if event.strip()]


def test_a_responses_stream_cut_mid_way_ends_with_a_typed_error_event(start_sim: StartSim,
                                                                      start_gateway: StartGateway) -> None:
    """The Responses API's events are typed (`event: <type>`, data with `type`): the gateway's own
    error event after a broken stream is one too (`error`, with `code` and `message`), and still
    carries the OpenAI error object the openai SDK raises on."""
    gw = raw_gateway(start_sim, start_gateway, RESPONSE_START)
    body = {"model": "kimi-k3", "input": "Hi", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", gw.v1 + "/responses", json=body) as response:
        received = response.read()
    events = events_of(received)
    assert received.startswith(b"".join(RESPONSE_START)) and len(events) == len(RESPONSE_START) + 1
    name, data = events[-1].split(b"\n")
    assert name == b"event: error"
    error = json.loads(data.removeprefix(b"data: "))
    assert error["type"] == "error" and error["code"] == "upstream_error" and "incomplete" in error["message"]
    assert error["error"]["message"] == error["message"]
    with pytest.raises(openai.APIError, match="incomplete"):
        list(openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).responses.create(
            model="kimi-k3", input="Hi", max_output_tokens=5, stream=True))
    gw.wait_until_idle()


@pytest.mark.parametrize("path", ["/messages", "/responses"])
def test_an_engines_own_error_event_mid_stream_is_the_last_event(start_sim: StartSim, start_gateway: StartGateway,
                                                                 path: str) -> None:
    """An engine that reports its failure in the stream (Anthropic's `event: error`, the Responses
    API's `error` event) has said why the answer is incomplete: the client gets that event, once,
    not followed by the gateway's own error; the worker is charged with the failure."""
    anthropic_api = path == "/messages"
    chunks = [*MESSAGE_START, MESSAGE_ERROR] if anthropic_api else [*RESPONSE_START, RESPONSE_ERROR]
    gw = raw_gateway(start_sim, start_gateway, chunks)
    body: dict[str, Any] = ({"model": "kimi-k3", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
                            if anthropic_api else {"model": "kimi-k3", "input": "Hi", "max_output_tokens": 5})
    with httpx.stream("POST", gw.v1 + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        received = response.read()
    assert received == b"".join(chunks)
    api = "messages" if anthropic_api else "responses"
    # a stream the engine broke is counted as the upstream's failure
    gw.wait_for_metric(f'kimi_gateway_requests_total{{api="{api}",pool="p",status_class="5xx"}}', lambda n: n == 1)


def test_a_non_streaming_messages_request_to_a_raw_stream_sim_gets_a_message(start_sim: StartSim,
                                                                             start_gateway: StartGateway) -> None:
    """The simulator's `raw_stream_chunks` fault is for streams only: a non-streaming Messages
    request still gets an Anthropic `message` (it got a chat completion)."""
    gw = raw_gateway(start_sim, start_gateway, MESSAGE_START)
    answer = httpx.post(gw.v1 + "/messages", json={"model": "kimi-k3", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert answer["type"] == "message" and answer["usage"]["output_tokens"] == 2


@pytest.mark.anyio
async def test_messages_and_responses_cut_at_shutdown_end_in_their_own_shapes(
        start_sim: StartSim, start_gateway_process: Callable[..., GatewayProcess]) -> None:
    """Past the grace period the gateway ends what is still running (gateway/serving/lifecycle.py): a
    Messages stream with Anthropic's `event: error` (overloaded: retry elsewhere), a Messages
    request still waiting with Anthropic's 529, a Responses stream with a typed `error` event."""
    sim = start_sim("vllm", tpot_s=0.1)
    gw = start_gateway_process([pool("p", "vllm", [sim.url], 131072)],
                               shutdown={"drain_delay": 0.2, "grace_period": 0.5})
    hello = [{"role": "user", "content": "hi"}]
    bodies = {"messages": {"model": "kimi-k3", "max_tokens": 500, "messages": hello, "stream": True},
              "responses": {"model": "kimi-k3", "max_output_tokens": 500, "input": "hi", "stream": True}}
    async with httpx.AsyncClient(timeout=30) as client:
        flowing = {name: asyncio.Event() for name in bodies}

        async def read(name: str) -> bytes:
            received = b""
            async with client.stream("POST", f"{gw.url}/v1/{name}", json=bodies[name]) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw():
                    received += chunk
                    flowing[name].set()
            return received

        streams = {name: asyncio.create_task(read(name)) for name in bodies}
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing.values())), timeout=10)
        waiting = asyncio.create_task(client.post(gw.url + "/v1/messages", json={
            "model": "kimi-k3", "max_tokens": 5, "messages": hello, "x_sim_faults": {"hang_before_headers": True}}))
        await sim.engine.async_wait_for(lambda: len(sim.engine.records) == 3)
        gw.proc.send_signal(signal.SIGTERM)
        assert await gw.wait_exit(timeout=10) == 0
        messages = await asyncio.wait_for(streams["messages"], timeout=5)
        responses = await asyncio.wait_for(streams["responses"], timeout=5)
        answer = await asyncio.wait_for(waiting, timeout=5)
    name, data = events_of(messages)[-1].split(b"\n")
    assert name == b"event: error", messages[-300:]
    assert json.loads(data.removeprefix(b"data: "))["error"]["type"] == "overloaded_error"
    name, data = events_of(responses)[-1].split(b"\n")
    assert name == b"event: error", responses[-300:]
    assert json.loads(data.removeprefix(b"data: "))["code"] == "shutting_down"
    assert answer.status_code == 529 and answer.headers["retry-after"] == "1", answer.text
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "overloaded_error"
    assert answer.json()["request_id"] == answer.headers["request-id"] == answer.headers["x-request-id"]


def test_unknown_paths_under_messages_answer_anthropics_404(target: Target) -> None:
    """`/v1/messages/batches` (Anthropic's batch API, not served) and `/v1/messages/` are unknown
    paths under the Anthropic endpoints: a 404 in Anthropic's shape, which its SDK reads."""
    for path in ("/v1/messages/batches", "/v1/messages/", "/v1/messages/batches/msgbatch_1/results"):
        response = target.client.post(path, json={"requests": []})
        assert response.status_code == 404, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
        assert path in body["error"]["message"]
    assert "error" in target.client.post("/v1/nothing", json={}).json()  # elsewhere: OpenAI's shape
