"""The Responses API pieces without a socket: its routing features, the relay's view of its events
(held preamble, terminal events, nested usage, the created id) and the size checks."""

from __future__ import annotations

import orjson
import pytest

from gateway.affinity.hashing import PrefixHasher
from gateway.affinity.params import AffinityConfig
from gateway.config import GatewayConfig
from gateway.dialects.chat import chat_features
from gateway.dialects.responses import responses_features
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.parsing import BodyParser
from gateway.protocol.openai import ChatCompletionRequest
from gateway.protocol.responses import ResponsesRequest, chat_usage, response_id_of
from gateway.protocol.sse import SSETap
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator
from gateway.streaming import Held, classify_event

ESTIMATOR = TokenEstimator(EstimationConfig())
HASHER = PrefixHasher(AffinityConfig())


def event(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields})


def test_a_responses_request_is_counted_like_the_same_chat() -> None:
    """instructions = a system message, a string input = a user message; the same tokens and the same
    prefix hashes as the chat request with those messages, so both APIs meet the same cache entries."""
    text = "Explain the KV cache in two sentences. " * 30
    wire = ResponsesRequest.model_validate({"model": "kimi-k3", "instructions": "Be brief.", "input": text,
                                            "max_output_tokens": 77})
    chat = ChatCompletionRequest.model_validate({"model": "kimi-k3", "max_tokens": 77, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]})
    got = responses_features(wire, "kimi-k3", ESTIMATOR, HASHER)
    want = chat_features(chat, "kimi-k3", ESTIMATOR, HASHER)
    assert (got.prompt_tokens, got.output_tokens, got.estimate_method) == (want.prompt_tokens, 77, "bytes")
    assert got.prefix is not None and want.prefix is not None and got.prefix.hashes == want.prefix.hashes
    assert got.api == "responses" and got.include_usage and got.store and got.previous_response_id is None


def test_input_items_count_text_images_and_tool_calls() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a" * 400},
                                     {"type": "input_image", "image_url": "https://example.com/x.png"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "' + "b" * 400 + '"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "c" * 400},
    ]
    wire = ResponsesRequest.model_validate({"model": "kimi-k3", "input": items, "previous_response_id": "resp_1",
                                            "store": False})
    got = responses_features(wire, "kimi-k3", ESTIMATOR)
    config = ESTIMATOR.config
    text_only = ESTIMATOR.utf8_tokens(b"a" * 400 + b"lookup" + items[1]["arguments"].encode() + b"c" * 400)
    assert got.prompt_tokens == (config.tokens_per_request + 3 * config.tokens_per_message + text_only
                                 + config.image_tokens_default)
    assert got.modalities == {"text", "image"} and got.estimate_method == "bytes+default"
    assert got.previous_response_id == "resp_1" and not got.store


@pytest.mark.parametrize("body", [
    {"model": "kimi-k3"},
    {"model": "kimi-k3", "input": 5},
    {"model": "kimi-k3", "input": "x", "max_output_tokens": 0},
    {"model": "kimi-k3", "input": "x", "max_output_tokens": "5"},
    {"model": "kimi-k3", "input": "x", "stream": "yes"},
    {"model": "kimi-k3", "input": "x", "previous_response_id": ""},
])
def test_bad_bodies_are_refused_with_the_field_named(body: dict[str, object]) -> None:
    parser = BodyParser(_config())
    with pytest.raises(InvalidRequest) as refused:
        parser.validate("responses", body)
    assert refused.value.status == 400 and refused.value.param


def test_a_body_larger_than_every_pool_is_refused_before_validation() -> None:
    parser = BodyParser(_config())
    huge = {"model": "kimi-k3", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * 600_000}]}]}
    with pytest.raises(ContextLengthExceeded) as refused:
        parser.decode("responses", orjson.dumps(huge))
    assert refused.value.param == "input"
    with pytest.raises(InvalidRequest) as many:
        parser.decode("responses", orjson.dumps({"model": "kimi-k3", "input": [{"role": "user", "content": "x"}] * 30}))
    assert many.value.code == "too_many_messages"


def _config() -> GatewayConfig:
    return GatewayConfig.model_validate({"max_messages": 20, "pools": [
        {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1"], "max_context_tokens": 65536}]})


@pytest.mark.parametrize(("raw", "verdict"), [
    (event("response.created", response={"id": "resp_1", "status": "in_progress", "error": None}), Held.EMPTY),
    (event("response.in_progress", response={"id": "resp_1"}), Held.EMPTY),
    (event("response.output_item.added", item={"type": "message", "content": []}), Held.EMPTY),
    (event("response.content_part.added", part={"type": "output_text", "text": ""}), Held.EMPTY),
    (event("response.output_text.delta", delta="Hi"), Held.CONTENT),
    (event("response.reasoning_text.delta", delta="Hmm"), Held.CONTENT),
    (event("response.function_call_arguments.delta", delta="{"), Held.CONTENT),
    (event("response.completed", response={"id": "resp_1"}), Held.CONTENT),
    (event("error", code="server_error", message="boom"), Held.ERROR),
    (event("response.failed", response={"id": "resp_1", "error": {"message": "boom"}}), Held.ERROR),
])
def test_responses_events_are_held_until_the_first_token(raw: bytes, verdict: Held) -> None:
    assert classify_event(raw)[0] is verdict


STREAM = b"".join(e + b"\n\n" for e in (
    event("response.created", response={"id": "resp_abc", "usage": None}),
    event("response.in_progress", response={"id": "resp_abc", "usage": None}),
    event("response.output_text.delta", delta='"type":"response.completed" is only text here'),
    event("response.completed", response={"id": "resp_abc", "usage": {"input_tokens": 9, "output_tokens": 2,
                                                                       "total_tokens": 11}}),
))


@pytest.mark.parametrize("size", [1, 5, 64, len(STREAM)])
def test_tap_ends_on_the_terminal_event_and_reads_the_nested_usage(size: int) -> None:
    tap = SSETap("responses")
    seen: list[str] = []
    tap.on_response_id = seen.append
    last = STREAM.rindex(b"event: response.completed")
    for i in range(0, len(STREAM), size):
        tap.feed(STREAM[i:i + size])
        if i + size <= last:
            assert not tap.done  # generated text that quotes the marker does not end it
    assert tap.done and seen == ["resp_abc"]
    assert tap.usage == {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11, "prompt_tokens": 9,
                         "completion_tokens": 2}


def test_ids_and_usage_helpers() -> None:
    assert response_id_of({"id": "resp_1", "object": "response"}) == "resp_1"
    assert response_id_of({"type": "response.created", "response": {"id": "resp_2"}}) == "resp_2"
    assert response_id_of({"error": {"message": "x"}}) is None
    assert response_id_of([1]) is None
    assert chat_usage({"prompt_tokens": 1, "completion_tokens": 2}) == {"prompt_tokens": 1, "completion_tokens": 2}


def test_an_unreadable_image_data_uri_names_its_input_item() -> None:
    wire = ResponsesRequest.model_validate({"model": "kimi-k3", "instructions": "Look.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png,notbase64"}]}]})
    with pytest.raises(InvalidRequest) as refused:
        responses_features(wire, "kimi-k3", ESTIMATOR)
    assert refused.value.param == "input[1].content"
