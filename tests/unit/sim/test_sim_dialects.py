"""Per-engine wording and shapes of the simulator's errors, and its metric names (pure functions)."""

from __future__ import annotations

import orjson
import pytest

from gateway.sim.dialects import (
    dialect_for,
    sglang_context_error,
    vllm_context_error,
    vllm_legacy_context_error,
)


@pytest.mark.parametrize(("prompt", "output", "expected"), [
    (99, None, None),
    (90, 10, None),
    (95, 10, None),    # vLLM 0.32 serves it with 5 output tokens (it used to refuse prompt + max_tokens > 100)
    (99, 100, None),
    (100, None, ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")),
    (100, 5, ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")),
    (250, None, ("This model's maximum context length is 100 tokens. However, your prompt contains at least 101 "
                 "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                 "of the input prompt. (parameter=input_tokens, value=101)", "input_tokens")),
    (101, 1, ("This model's maximum context length is 100 tokens. However, your prompt contains at least 101 "
              "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
              "of the input prompt. (parameter=input_tokens, value=101)", "input_tokens")),
    (10, 101, ("max_tokens=101 cannot be greater than max_model_len=100. Please request fewer output tokens. "
               "(parameter=max_tokens, value=101)", "max_tokens")),
])
def test_vllm_current_context_wording(prompt: int, output: int | None,
                                      expected: tuple[str, str] | None) -> None:
    """vLLM 0.32's refusals (vllm/renderers/params.py, serve/utils/api_utils.py, sampling_params.py)."""
    assert vllm_context_error(prompt, output, 100) == expected


def test_vllm_names_the_output_field_and_lets_pooling_fill_the_context() -> None:
    refused = vllm_context_error(1, 200, 100, "max_completion_tokens")
    assert refused is not None and refused[1] == "max_completion_tokens"
    assert refused[0].startswith("max_completion_tokens=200 cannot be greater than max_model_len=100.")
    assert vllm_context_error(100, None, 100, generate=False) is None  # a pooling request generates nothing


def test_vllm_legacy_context_wording() -> None:
    assert vllm_legacy_context_error(99, None, 100) is None
    assert vllm_legacy_context_error(100, None, 100) == (
        "This model's maximum context length is 100 tokens. However, you requested 100 tokens in the messages, "
        "Please reduce the length of the messages.", None)
    assert vllm_legacy_context_error(60, 40, 100) is None
    assert vllm_legacy_context_error(60, 41, 100) == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens (60 in the "
        "messages, 41 in the completion). Please reduce the length of the messages or completion.", None)


def test_sglang_context_wording() -> None:
    """SGLang 0.5.23 serves input + max_new_tokens == context_len (`> _max_req_len`); older releases refused it."""
    assert sglang_context_error(99, None, 100) is None
    assert sglang_context_error(100, None, 100) == (
        "The input (100 tokens) is longer than the model's context length (100 tokens).", None)
    assert sglang_context_error(60, 40, 100) is None
    assert sglang_context_error(61, 40, 100) == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. You requested a total "
        "of 101 tokens: 61 tokens from the input messages and 40 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit.", None)
    assert sglang_context_error(1, 101, 100) == (
        "max_completion_tokens is too large: 101.This model supports at most 100 completion tokens.", None)


def test_error_shapes() -> None:
    nested = dialect_for("vllm").check_context(200, None, 100, stream=True)
    assert nested is not None and nested.status == 400 and not nested.in_band_stream
    body = orjson.loads(nested.body)
    assert set(body) == {"error"}
    assert body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "input_tokens"
    assert body["error"]["code"] == 400
    flat = orjson.loads(dialect_for("ascend", "legacy").bad_request("nope").body)
    assert flat == {"object": "error", "message": "nope", "type": "BadRequestError", "param": None, "code": 400}
    assert dialect_for("vllm").check_context(50, 50, 100, stream=False) is None


def test_sglang_legacy_streams_context_errors_in_band() -> None:
    dialect = dialect_for("sglang", "legacy")
    plain = dialect.check_context(100, None, 100, stream=False)
    assert plain is not None and plain.status == 400 and not plain.in_band_stream
    in_band = dialect.check_context(100, None, 100, stream=True)
    assert in_band is not None and in_band.status == 200 and in_band.in_band_stream
    assert in_band.stream_event.startswith(b'data: {"error": {"object": "error", "message": "The input (100')
    assert in_band.stream_event.endswith(b'"code": 400}}\n\n')
    assert dialect.check_model("anything", ["kimi-k3"], ["kimi-k3"]) is None


def test_model_checks() -> None:
    reply = dialect_for("vllm").check_model("m2", ["kimi-k3", "k3", "sql-lora"], ["kimi-k3", "k3"])
    assert reply is not None and reply.status == 404
    # vLLM 0.32 `_check_model` lists the base model's names, not the adapters
    assert orjson.loads(reply.body)["error"]["message"] == "The model `m2` does not exist. Valid aliases: kimi-k3, k3."
    assert dialect_for("vllm").check_model("sql-lora", ["kimi-k3", "sql-lora"], ["kimi-k3"]) is None
    assert dialect_for("vllm").check_model(None, ["kimi-k3"], ["kimi-k3"]) is None
    sglang = dialect_for("sglang").check_model("m2", ["kimi-k3", "k3"], ["kimi-k3", "k3"])
    assert sglang is not None and sglang.status == 400
    assert orjson.loads(sglang.body)["message"] == "The model `m2` does not exist. The served model name is `kimi-k3`."


def test_metric_names_and_labels() -> None:
    vllm = dialect_for("vllm")
    assert (vllm.metric_names.running, vllm.metric_names.waiting, vllm.metric_names.kv_usage) == (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert dialect_for("ascend").metric_names == vllm.metric_names
    assert vllm.metric_labels("m") == {"model_name": "m", "engine": "0"}
    sglang = dialect_for("sglang")
    assert (sglang.metric_names.running, sglang.metric_names.waiting, sglang.metric_names.kv_usage) == (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
    assert sglang.metric_labels("m") == {"model_name": "m"}
    assert dialect_for("vllm", "legacy").metric_names.kv_usage == "vllm:gpu_cache_usage_perc"
