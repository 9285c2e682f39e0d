"""Engine error wordings and the normalisation of engine errors to OpenAI error objects."""

from __future__ import annotations

import orjson
import pytest

from gateway.backends.engine_kinds import ENGINES, PROBES, is_context_too_long
from gateway.errors import ContextLengthExceeded, error_bytes_from_upstream
from gateway.protocol.openai import ChatCompletionRequest, describe_validation_error


@pytest.mark.parametrize("body", [
    # vLLM (flat and nested shapes)
    b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens. However, you requested '
    b'2100 tokens (2000 in the messages, 100 in the completion).","type":"BadRequestError","param":null,"code":400}',
    b'{"error":{"message":"The decoder prompt (length 3000) is longer than the maximum model length of 2048.",'
    b'"type":"BadRequestError","param":null,"code":400}}',
    # SGLang
    b'{"object":"error","message":"The input (3000 tokens) is longer than the model\'s context length '
    b'(2048 tokens).","type":"BadRequestError","param":null,"code":400}',
    # llama.cpp
    b'{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it",'
    b'"type":"exceed_context_size_error","n_prompt_tokens":3000,"n_ctx":2048}}',
])
def test_context_too_long_wordings(body: bytes) -> None:
    assert is_context_too_long(400, body)
    assert not is_context_too_long(500, body)


def test_other_400s_are_not_too_long() -> None:
    assert not is_context_too_long(400, b'{"object":"error","message":"temperature must be >= 0"}')


@pytest.mark.parametrize(("status", "body", "code", "expected"), [
    (400, b'{"object":"error","message":"bad temperature","type":"BadRequestError","param":null,"code":400}', None,
     {"message": "bad temperature", "type": "invalid_request_error", "param": None, "code": None}),
    (400, b'{"error":{"message":"x","type":"y","param":"temperature","code":"z"},"extra":1}', None,
     {"message": "x", "type": "invalid_request_error", "param": "temperature", "code": "z"}),
    (400, b'{"error":{"code":400,"message":"request (2915 tokens) exceeds the available context size (2048 tokens)",'
          b'"type":"exceed_context_size_error","n_prompt_tokens":2915,"n_ctx":2048}}', "context_length_exceeded",
     {"message": "request (2915 tokens) exceeds the available context size (2048 tokens)",
      "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"}),
    (503, b"<html>down</html>", None, {"message": "<html>down</html>", "type": "server_error", "param": None,
                                       "code": None}),
    (400, b"", None, {"message": "The inference server answered HTTP 400.", "type": "invalid_request_error",
                      "param": None, "code": None}),
])
def test_engine_errors_become_exact_openai_objects(status: int, body: bytes, code: str | None,
                                                   expected: dict[str, object]) -> None:
    assert orjson.loads(error_bytes_from_upstream(status, body, code)) == {"error": expected}


def test_gateway_error_shape() -> None:
    error = ContextLengthExceeded("too long", param="messages")
    assert error.status == 400
    assert orjson.loads(error.to_bytes()) == {"error": {"message": "too long", "type": "invalid_request_error",
                                                        "param": "messages", "code": "context_length_exceeded"}}


@pytest.mark.parametrize(("payload", "param"), [
    ({"model": "k"}, "messages"),
    ({"model": "k", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ({"model": "k", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"model": "k", "messages": [{"role": "user", "content": [{"type": 5}]}]}, "messages[0].content[0]"),
    ({"model": "k", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "k", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "k", "messages": [{"role": "assistant"}, {"role": "tool", "content": None}]}, "messages[1].content"),
])
def test_validation_errors_name_openai_style_params(payload: dict[str, object], param: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(payload)
    message, found = describe_validation_error(info.value)
    assert found == param and param in message


def test_only_assistant_and_function_turns_may_omit_content() -> None:
    request = ChatCompletionRequest.model_validate({"model": "k", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "function", "name": "w", "content": None},
    ]})
    assert [m.content for m in request.messages] == ["weather?", None, None]


def test_every_engine_kind_is_probed_on_an_endpoint_that_does_not_generate() -> None:
    """SGLang's `/health` runs a one-token generation (1 s at best, 503 during a long prefill): its
    workers are probed on `/ready`; the probe deadline is health.timeout plus the endpoint's
    own answer time."""
    assert set(PROBES) == set(ENGINES)
    assert {kind: spec.probe.path for kind, spec in ENGINES.items()} == {
        "vllm": "/health", "ascend": "/health", "sglang": "/ready", "llamacpp": "/health"}
    assert all(spec.probe is PROBES[kind] and spec.probe.timeout(2.0) == 2.0 for kind, spec in ENGINES.items())


@pytest.mark.parametrize(("engine", "prompt", "output", "accepted"), [
    # vLLM 0.32 / vllm-ascend: the prompt must leave a token; an output limit the context cannot hold
    # after it is shortened, one over the whole context refused
    ("vllm", 99, None, True), ("vllm", 100, None, False), ("vllm", 101, None, False),
    ("vllm", 90, 50, True), ("vllm", 90, 100, True), ("vllm", 90, 101, False), ("ascend", 99, 100, True),
    ("vllm", 100, 0, True),  # a pooling request may fill the context
    # SGLang 0.5.23: input < context and input + max_new_tokens <= context
    ("sglang", 99, None, True), ("sglang", 100, None, False), ("sglang", 60, 40, True),
    ("sglang", 61, 40, False), ("sglang", 100, 0, False),
    # llama.cpp: the prompt must leave a token; the output stops where the context ends
    ("llamacpp", 99, 5000, True), ("llamacpp", 100, 1, False),
])
def test_each_engine_kinds_context_rule(engine: str, prompt: int, output: int | None, accepted: bool) -> None:
    assert ENGINES[engine].accepts(prompt, output, 100) is accepted


def test_engine_default_output_runs_to_the_end_of_the_context_but_on_completions() -> None:
    assert ENGINES["vllm"].default_output("chat", 30, 100) == 70
    assert ENGINES["sglang"].default_output("responses", 30, 100) == 70
    assert ENGINES["vllm"].default_output("completions", 30, 100) == 16
    assert ENGINES["llamacpp"].default_output("completions", 30, 100) == 70


def test_vllm_032_wordings_are_context_errors() -> None:
    for message in (b"This model's maximum context length is 100 tokens. However, your prompt contains at least "
                    b"101 input tokens, which exceeds this limit even without any output tokens.",
                    b"max_tokens=32000 cannot be greater than max_model_len=16384. Please request fewer output "
                    b"tokens. (parameter=max_tokens, value=32000)"):
        assert is_context_too_long(400, b'{"error":{"message":"' + message + b'"}}')
