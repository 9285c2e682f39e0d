"""Anthropic Messages pieces on their own: the canonical chat form, features equal to the chat
twin's, usage and error mapping, the relay's view of Anthropic events, x-api-key auth."""

from __future__ import annotations

import base64
import json

import pytest

from gateway.affinity.hashing import PrefixHasher
from gateway.affinity.params import AffinityConfig
from gateway.auth.guard import MISSING_KEY, AuthGuard
from gateway.auth.keys import KeyRing, hash_key
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.params import ApiKeyConfig, AuthConfig
from gateway.dialects.chat import chat_features
from gateway.dialects.messages import MISSING_ANTHROPIC_KEY, AnthropicWire, MessagesDialect, messages_features
from gateway.errors import InvalidApiKey, NoCapacity
from gateway.observability.metrics import GatewayMetrics
from gateway.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    error_type,
    openai_usage,
    to_chat,
)
from gateway.protocol.openai import ChatCompletionRequest
from gateway.protocol.sse import SSETap
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator
from gateway.streaming import Held, Outcome, _error_event, classify_event

PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000040000000200802000000")).decode()  # a 64x32 PNG header

CONVERSATION = {
    "model": "kimi-k3", "max_tokens": 300, "stream": True, "metadata": {"user_id": "u1"},
    "system": [{"type": "text", "text": "You are Kimi."}, {"type": "text", "text": "Be brief."}],
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is on this picture, and the weather?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": PNG}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look, then call.", "signature": "s"},
                                          {"type": "text", "text": "A cat. Checking the weather."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                     {"type": "text", "text": "Thanks!"}]},
    ],
}

CHAT_TWIN = {
    "model": "kimi-k3", "max_tokens": 300, "stream": True, "user": "u1",
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "system", "content": "You are Kimi.\nBe brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is on this picture, and the weather?"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
        {"role": "assistant", "content": "A cat. Checking the weather.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "Thanks!"},
    ],
}


def test_to_chat_is_the_canonical_conversation() -> None:
    chat = to_chat(MessagesRequest.model_validate(CONVERSATION))
    assert chat["messages"][2].pop("reasoning_content") == "Look, then call."
    assert chat == CHAT_TWIN
    ChatCompletionRequest.model_validate(chat)


def test_features_equal_the_chat_twins() -> None:
    estimator = TokenEstimator(EstimationConfig())
    hasher = PrefixHasher(AffinityConfig(block_bytes=64))
    wire = AnthropicWire("messages", ChatCompletionRequest.model_validate(
        to_chat(MessagesRequest.model_validate(CONVERSATION))))
    messages = messages_features(wire, "kimi-k3", estimator, hasher)
    chat = chat_features(ChatCompletionRequest.model_validate(CHAT_TWIN), "kimi-k3", estimator, hasher)
    assert messages.api == "messages" and chat.api == "chat"
    assert messages.prompt_tokens == chat.prompt_tokens and messages.estimate_method == "bytes+pixels"
    assert messages.prefix is not None and messages.prefix == chat.prefix
    assert (messages.output_tokens, messages.stream, messages.session_key) == (300, True, "u1")
    assert messages.include_usage, "Anthropic streams carry usage: no usage patch"
    assert messages.modalities == frozenset({"text", "image"})


def test_count_tokens_reserves_no_output_and_charges_nothing() -> None:
    body = {k: v for k, v in CONVERSATION.items() if k not in ("max_tokens", "stream", "metadata")}
    wire = AnthropicWire("count_tokens", ChatCompletionRequest.model_validate(
        to_chat(CountTokensRequest.model_validate(body))))
    request = messages_features(wire, "kimi-k3", TokenEstimator(EstimationConfig()))
    assert request.api == "count_tokens" and request.output_tokens == 0 and not request.stream
    assert request.context_tokens(4096) == request.prompt_tokens > 0
    assert request.quota_tokens(4096) == 0


@pytest.mark.parametrize("body", [
    {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"model": "kimi-k3", "max_tokens": "5", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "kimi-k3", "max_tokens": 5, "messages": [{"role": "", "content": "hi"}]},
    {"model": "kimi-k3", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
    {"model": "kimi-k3", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}]},
    {"model": "kimi-k3", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "hi"}]},
])
def test_invalid_messages_requests(body: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MessagesRequest.model_validate(body)


def test_unknown_blocks_and_fields_pass() -> None:
    body = {"model": "kimi-k3", "max_tokens": 5, "top_k": 3, "messages": [{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "ok"}]}]}
    assert to_chat(MessagesRequest.model_validate(body))["messages"] == [{"role": "assistant", "content": "ok"}]


def test_a_turn_of_unknown_blocks_only_is_kept_empty_and_a_turn_of_tool_results_only_is_not() -> None:
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}
    body = {"model": "kimi-k3", "max_tokens": 5, "messages": [
        {"role": "user", "content": [document]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]}]}
    chat = to_chat(MessagesRequest.model_validate(body))
    assert chat["messages"] == [{"role": "user", "content": ""}, {"role": "assistant", "content": None},
                                {"role": "tool", "tool_call_id": "t", "content": "42"}]
    ChatCompletionRequest.model_validate(chat)


def test_openai_usage_counts_cached_input_as_prompt() -> None:
    assert openai_usage({"input_tokens": 1, "cache_read_input_tokens": 18, "output_tokens": 5}) == {
        "prompt_tokens": 19, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 18}}
    assert openai_usage({"input_tokens": 7, "cache_creation_input_tokens": 3, "output_tokens": 0}) == {
        "prompt_tokens": 10, "completion_tokens": 0}
    chat = {"prompt_tokens": 3, "completion_tokens": 2}
    assert openai_usage(chat) is chat


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
    (504, "timeout_error"), (529, "overloaded_error"),
])
def test_error_types_follow_anthropics_table(status: int, kind: str) -> None:
    assert error_type(status) == kind
    assert json.loads(error_body(status, "m", "r1")) == {"type": "error", "error": {"type": kind, "message": "m"},
                                                         "request_id": "r1"}


def test_gateway_and_engine_errors_are_rendered_anthropic_shaped_and_503_becomes_529() -> None:
    dialect = MessagesDialect()
    assert dialect.answer_status(503) == 529 and dialect.answer_status(400) == 400
    converted = dialect.error_bytes(NoCapacity("No inference server"), "r")
    assert json.loads(converted) == {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": "No inference server"}, "request_id": "r"}
    missing = json.loads(dialect.error_bytes(InvalidApiKey(MISSING_KEY), None))
    assert missing == {"type": "error", "error": {"type": "authentication_error", "message": MISSING_ANTHROPIC_KEY}}
    engine = b'{"object":"error","message":"bad field","type":"BadRequestError","param":null,"code":400}'
    assert json.loads(dialect.engine_error_bytes(400, engine, None, None, "r"))["error"] == {
        "type": "invalid_request_error", "message": "bad field"}
    assert json.loads(dialect.engine_error_bytes(502, b"<html>bad gateway</html>", None, None, None))["error"] == {
        "type": "api_error", "message": "<html>bad gateway</html>"}


def sse(kind: str, payload: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}".encode()


def test_held_start_knows_anthropic_events() -> None:
    assert classify_event(sse("message_start", {"message": {"usage": {"input_tokens": 3}}}))[0] is Held.EMPTY
    assert classify_event(sse("ping", {}))[0] is Held.EMPTY
    for block in ({"type": "text", "text": ""}, {"type": "thinking", "thinking": ""},
                  {"type": "tool_use", "id": "t", "name": "f", "input": {}}):
        assert classify_event(sse("content_block_start", {"index": 0, "content_block": block}))[0] is Held.CONTENT
    assert classify_event(sse("content_block_delta", {"delta": {"type": "text_delta", "text": "a"}}))[0] \
        is Held.CONTENT
    verdict, payload = classify_event(sse("error", {"error": {"type": "overloaded_error", "message": "busy"}}))
    assert verdict is Held.ERROR
    assert _error_event(payload).outcome is Outcome.PROTOCOL_ERROR  # busy: fail over
    bad = sse("error", {"error": {"type": "invalid_request_error", "message": "bad"}})
    failure = _error_event(classify_event(bad)[1])
    assert (failure.outcome, failure.status) == (Outcome.CLIENT_ERROR, 400)  # the request's: passed on


def test_tap_merges_anthropic_usage_and_sees_message_stop() -> None:
    tap = SSETap("messages")
    stream = b"\n\n".join([
        sse("message_start", {"message": {"id": "m", "usage": {"input_tokens": 2, "cache_read_input_tokens": 16,
                                                               "output_tokens": 0}}}),
        sse("content_block_delta", {"delta": {"type": "text_delta", "text": '"usage":{ in text'}}),
        sse("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}),
    ]) + b"\n\n"
    for i in range(0, len(stream), 7):
        tap.feed(stream[i:i + 7])
    assert not tap.done
    assert tap.usage == {"prompt_tokens": 18, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 16}}
    tap.feed(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert tap.done and tap.events == 4


def test_x_api_key_is_the_same_key_as_bearer() -> None:
    key = "sk-test-" + "a" * 40
    guard = AuthGuard(AuthConfig(), KeyRing([ApiKeyConfig(name="a", sha256=hash_key(key))]), MemoryRateLimiter(),
                      GatewayMetrics())
    assert guard.authenticate_headers([(b"x-api-key", key.encode())]).name == "a"
    both = [(b"x-api-key", key.encode()), (b"authorization", f"Bearer {key}".encode())]
    assert guard.authenticate_headers(both).name == "a"
    with pytest.raises(InvalidApiKey):
        guard.authenticate_headers([(b"x-api-key", key.encode()), (b"authorization", b"Bearer other")])


def test_pools_by_api_from_the_engine_table_or_the_pools_own_list() -> None:
    from gateway.backends.engine_kinds import ENGINES
    from gateway.backends.pool_params import PoolConfig
    from gateway.errors import ApiNotServed
    from gateway.routing.pools import fitting_pools, serves, skipped_pools

    assert all({"messages", "count_tokens"} <= spec.apis for spec in ENGINES.values())
    old = PoolConfig(name="old", engine="sglang", workers=["http://a:1"], max_context_tokens=8192,
                     apis=["chat", "completions"])
    new = PoolConfig(name="new", engine="vllm", workers=["http://b:1"], max_context_tokens=65536)
    assert serves(old, "chat") and not serves(old, "messages") and serves(new, "count_tokens")
    wire = AnthropicWire("messages", ChatCompletionRequest.model_validate(
        to_chat(MessagesRequest.model_validate({"model": "kimi-k3", "max_tokens": 10,
                                                "messages": [{"role": "user", "content": "hi"}]}))))
    request = messages_features(wire, "kimi-k3", TokenEstimator(EstimationConfig()))
    assert fitting_pools(request, [old, new]) == [new]
    assert skipped_pools(request, [old, new]) == ["old"]
    with pytest.raises(ApiNotServed):
        fitting_pools(request, [old])


def test_a_screenshot_in_a_tool_result_is_counted() -> None:
    def estimate(result: list[dict[str, object]]) -> int:
        body = {"model": "kimi-k3", "max_tokens": 10, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": result}]}]}
        wire = AnthropicWire("messages", ChatCompletionRequest.model_validate(
            to_chat(MessagesRequest.model_validate(body))))
        return messages_features(wire, "kimi-k3", TokenEstimator(EstimationConfig())).prompt_tokens

    text = [{"type": "text", "text": "the screen"}]
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/screen.png"}}
    assert estimate([*text, image]) >= estimate(text) + EstimationConfig().image_tokens_default
    with pytest.raises(ValueError):
        MessagesRequest.model_validate({"model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": 5}]}]}]})


def test_a_messages_answer_is_continued_by_its_chat_twin_and_ended_in_anthropic_s_events() -> None:
    from gateway.protocol.anthropic import continuation_chat, message_end_events, text_delta_event

    body = {"model": "m", "max_tokens": 9, "system": "be brief", "temperature": 0.5, "top_k": 3,
            "stop_sequences": ["END"], "messages": [{"role": "user", "content": "hi"}]}
    chat = continuation_chat(body)
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_k"], chat["stop"]) == (9, 0.5, 3, ["END"])
    assert "top_p" not in chat
    assert text_delta_event(2, "a\n") == (b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                                          b'"index":2,"delta":{"type":"text_delta","text":"a\\n"}}\n\n')
    end = message_end_events(0, "max_tokens", {"prompt_tokens": 5, "completion_tokens": 7}).split(b"\n\n")
    assert [e.split(b"\n")[0] for e in end if e] == [b"event: content_block_stop", b"event: message_delta",
                                                     b"event: message_stop"]
    assert b'"usage":{"input_tokens":5,"output_tokens":7}' in end[1] and b'"stop_reason":"max_tokens"' in end[1]
