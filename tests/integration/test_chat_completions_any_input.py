"""Property-based robustness: arbitrary and adversarial bodies and headers against a real gateway.

One gateway and one simulated vLLM engine are started for the whole module. Every answer must be
a 200 from the engine or a 4xx whose body is exactly an OpenAI error object; never a 5xx, never a
non-JSON body, never a hang. Every few examples a normal request must still succeed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import parse_config
from gateway.serving.server import ThreadedServer
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig
from tests.support import pool

MAX_CONTEXT = 8192  # small, so a random max_tokens can make the simulated engine write at most ~8K words
TIMEOUT = httpx.Timeout(10.0)
CHECK_EVERY = 10
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NORMAL_CHAT: dict[str, Any] = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NORMAL_COMPLETION: dict[str, Any] = {"model": "kimi-k3", "prompt": "Once", "max_tokens": 2}
PATHS = ("/v1/chat/completions", "/v1/completions")


class Target:
    """The module's gateway, an httpx client to it, and a counter of examples sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=TIMEOUT)
        self.sent = 0


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    sims = [ThreadedServer(create_sim_app(SimConfig(engine="vllm", max_context_tokens=MAX_CONTEXT))).start()
            for _ in range(2)]
    # The session policy: X-Session-ID (or `user`) picks the worker, so odd session ids are hashed.
    config = parse_config({"pools": [pool("p", "vllm", [s.url for s in sims], MAX_CONTEXT, default_output_tokens=16,
                                          policy="session")],
                           "health": {"interval": 0.5, "timeout": 1.0}}, environ={})
    gateway = ThreadedServer(create_app(config)).start()
    t = Target(gateway.url)
    try:
        yield t
    finally:
        t.client.close()
        servers = [gateway, *sims]
        for server in servers:
            server.server.should_exit = True
        for server in servers:
            server.stop()


# --- the property -------------------------------------------------------------------------------


def assert_openai_error_body(response: httpx.Response) -> None:
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    data = response.json()
    assert isinstance(data, dict) and set(data) == {"error"}, data
    error = data["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def check_answer(t: Target, path: str, content: bytes, headers: dict[str, Any] | None = None) -> httpx.Response:
    """Send one body, check the property, and every CHECK_EVERY examples that a normal request works."""
    all_headers: dict[str, Any] = {"content-type": "application/json", **(headers or {})}
    with t.client.stream("POST", path, content=content, headers=all_headers) as response:
        response.read()
    assert response.status_code < 500, (response.status_code, response.text[:2000], content[:2000])
    assert response.headers.get("x-request-id"), response.headers
    if response.status_code == 200:
        assert response.headers.get("x-kimi-gateway-worker") in ("p/0", "p/1"), response.headers
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.content.rstrip().endswith(b"data: [DONE]"), response.content[-500:]
        else:
            assert isinstance(response.json(), dict)
    else:
        assert 400 <= response.status_code < 500, response.status_code
        assert_openai_error_body(response)
    t.sent += 1
    if t.sent % CHECK_EVERY == 0:
        assert_still_serving(t)
    return response


def assert_still_serving(t: Target) -> None:
    for path, body in (("/v1/chat/completions", NORMAL_CHAT), ("/v1/completions", NORMAL_COMPLETION)):
        response = t.client.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


# --- strategies ---------------------------------------------------------------------------------

safe_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
scalars = (st.none() | st.booleans()
           | st.integers(min_value=-(2**64), max_value=2**64)
           | st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30])
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, 1.5, 2.0**31])
           | safe_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(safe_text, inner, max_size=5), max_leaves=25)
dump_style = st.sampled_from(["ascii", "utf8"])


def dumps(value: Any, style: str) -> bytes:
    return json.dumps(value, ensure_ascii=(style == "ascii"), allow_nan=False).encode("utf-8")


CHAT_FIELDS = ["model", "messages", "messages.0", "messages.0.role", "messages.0.content", "messages.0.name",
               "messages.0.content.0", "messages.0.content.0.type", "messages.0.content.0.text",
               "messages.0.content.1.image_url", "messages.0.content.1.image_url.url",
               "messages.0.content.1.image_url.detail", "max_tokens", "max_completion_tokens", "stream",
               "stream_options", "stream_options.include_usage", "n", "user", "temperature", "tools"]
COMPLETION_FIELDS = ["model", "prompt", "prompt.0", "max_tokens", "stream", "stream_options", "n", "user", "echo"]


def valid_chat() -> dict[str, Any]:
    return {"model": "kimi-k3", "max_tokens": 2, "stream": False, "stream_options": {"include_usage": True},
            "n": 1, "user": "u", "temperature": 0.5, "tools": [],
            "messages": [{"role": "user", "name": "x", "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]}]}


def valid_completion() -> dict[str, Any]:
    return {"model": "kimi-k3", "prompt": ["Once"], "max_tokens": 2, "stream": False,
            "stream_options": {"include_usage": True}, "n": 1, "user": "u", "echo": False}


def replace_at(body: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node: Any = body
    keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return body


# --- properties ---------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(value=json_values, style=dump_style, path=st.sampled_from(PATHS))
def test_any_json_value_as_the_body(target: Target, value: Any, style: str, path: str) -> None:
    check_answer(target, path, dumps(value, style))


@PROPERTY_SETTINGS
@given(extra=st.dictionaries(safe_text, json_values, max_size=4), style=dump_style,
       path=st.sampled_from(PATHS))
def test_random_json_object_with_and_without_a_model(target: Target, extra: dict[str, Any], style: str,
                                                     path: str) -> None:
    check_answer(target, path, dumps({"model": "kimi-k3", **extra}, style))


@PROPERTY_SETTINGS
@given(field=st.sampled_from(CHAT_FIELDS), value=json_values, stream=st.booleans(), style=dump_style)
def test_chat_with_one_field_replaced_by_anything(target: Target, field: str, value: Any, stream: bool,
                                                  style: str) -> None:
    body = replace_at({**valid_chat(), "stream": stream}, field, value)
    check_answer(target, "/v1/chat/completions", dumps(body, style))


@PROPERTY_SETTINGS
@given(field=st.sampled_from(COMPLETION_FIELDS), value=json_values, stream=st.booleans(), style=dump_style)
def test_completion_with_one_field_replaced_by_anything(target: Target, field: str, value: Any, stream: bool,
                                                        style: str) -> None:
    body = replace_at({**valid_completion(), "stream": stream}, field, value)
    check_answer(target, "/v1/completions", dumps(body, style))


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=300) | st.builds(lambda b: b'{"model": "kimi-k3", "messages": "' + b + b'"}',
                                                 st.binary(max_size=60)),
       path=st.sampled_from(PATHS))
def test_random_bytes_and_invalid_utf8(target: Target, data: bytes, path: str) -> None:
    check_answer(target, path, data)


part_types = st.sampled_from(["text", "image_url", "input_audio", "video_url", "file", "refusal", "bogus", ""])
image_urls = st.one_of(
    safe_text,
    st.sampled_from(["data:", "data:image/png;base64,", "data:image/png;base64,@@@",
                     "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8Bw",
                     "data:image/jpeg;base64,/9j/4AAQ", "data:text/plain,hello", "http://", "https://[::1",
                     "http://example.com/" + "a" * 5000, "file:///etc/passwd", "ftp://x/y.png"]),
)
content_parts = st.fixed_dictionaries(
    {"type": part_types},
    optional={"text": safe_text | json_values,
              "image_url": st.fixed_dictionaries({"url": image_urls},
                                                 optional={"detail": st.sampled_from(["auto", "low", "high", "x"])})
              | json_values,
              "input_audio": st.fixed_dictionaries({"data": safe_text, "format": safe_text}) | json_values,
              "video_url": json_values, "file": json_values, "refusal": safe_text | json_values})


@PROPERTY_SETTINGS
@given(parts=st.lists(content_parts, max_size=6), stream=st.booleans(),
       role=st.sampled_from(["user", "system", "assistant", "tool", "developer"]))
def test_random_content_parts(target: Target, parts: list[dict[str, Any]], stream: bool, role: str) -> None:
    body = {"model": "kimi-k3", "max_tokens": 2, "stream": stream, "messages": [{"role": role, "content": parts}]}
    check_answer(target, "/v1/chat/completions", dumps(body, "utf8"))


# Legal field-value bytes (RFC 9110): visible ASCII and obs-text, spaces and tabs only inside.
header_values = st.binary(min_size=1, max_size=200).map(
    lambda b: bytes(c for c in b if 0x21 <= c <= 0x7E or c >= 0x80 or c in (0x20, 0x09)).strip(b" \t")
).filter(bool) | st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=300)


@PROPERTY_SETTINGS
@given(request_id=st.none() | header_values, session_id=st.none() | header_values, stream=st.booleans(),
       path=st.sampled_from(PATHS))
def test_odd_but_legal_request_and_session_ids(target: Target, request_id: bytes | str | None,
                                               session_id: bytes | str | None, stream: bool, path: str) -> None:
    headers: dict[str, Any] = {}
    if request_id is not None:
        headers["x-request-id"] = request_id
    if session_id is not None:
        headers["x-session-id"] = session_id
    body = NORMAL_CHAT if path.endswith("chat/completions") else NORMAL_COMPLETION
    response = check_answer(target, path, dumps({**body, "stream": stream}, "ascii"), headers)
    assert response.status_code == 200, response.text
    if session_id is not None:  # the same session sticks to the same worker
        again = check_answer(target, path, dumps({**body, "stream": stream}, "ascii"), headers)
        assert again.headers["x-kimi-gateway-worker"] == response.headers["x-kimi-gateway-worker"]
    echoed = response.headers["x-request-id"]
    sent = request_id.decode("latin-1") if isinstance(request_id, bytes) else request_id
    if sent is not None and 0 < len(sent) <= 128 and sent.isascii() and sent.isprintable():
        assert echoed == sent
    else:
        assert len(echoed) == 32 and all(c in "0123456789abcdef" for c in echoed)


def test_floats_never_leak_as_non_json(target: Target) -> None:
    """NaN and Infinity are not JSON; Python's json would write them, the gateway must refuse them."""
    for token in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + token + b"}"
        response = check_answer(target, "/v1/chat/completions", body)
        assert response.status_code == 400, response.text
