"""Token accounting, config and fault semantics, and the engine's thread-safe waiting (no HTTP)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from gateway.sim import SimConfig, SimFaults, SimWorkerState
from gateway.sim.tokens import (
    OUTPUT_WORDS,
    FieldValidationError,
    PromptError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    engine_ints,
    generated_count,
    messages_max_tokens,
    output_text,
    output_token,
    requested_output_tokens,
    responses_output_limit,
)
from gateway.sim.worker_state import ActiveRequest, ProportionalKVUsage

CONFIG = SimConfig(engine="vllm", max_context_tokens=1000)


def test_chat_prompt_tokens() -> None:
    messages = [{"role": "system", "content": "abcde"},  # 5 bytes
                {"role": "user", "content": [{"type": "text", "text": "é"},  # 2 bytes
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "image_url", "image_url": {"url": "y"}},
                                             {"type": "video_url", "video_url": {"url": "z"}}]},
                {"role": "assistant", "content": None}]
    assert chat_prompt_tokens(messages, CONFIG) == 2 + 2 * 256 + 3 * 4  # ceil(7 / 4) = 2
    custom = CONFIG.model_copy(update={"bytes_per_token": 1.0, "image_tokens": 10, "message_overhead_tokens": 0})
    assert chat_prompt_tokens(messages, custom) == 7 + 20


@pytest.mark.parametrize("bad", [None, [], "hi", [1], [{"content": 5}], [{"content": [7]}]])
def test_chat_prompt_errors(bad: object) -> None:
    with pytest.raises(PromptError):
        chat_prompt_tokens(bad, CONFIG)


def test_completion_prompt_forms() -> None:
    assert completion_prompt_tokens("abcdefghi", CONFIG) == [3]
    assert completion_prompt_tokens(["a", "東京"], CONFIG) == [1, 2]
    assert completion_prompt_tokens([1, 2, 3], CONFIG) == [3]
    assert completion_prompt_tokens([[1, 2], [3]], CONFIG) == [2, 1]
    assert completion_prompt_tokens("", CONFIG) == [0]
    for bad in (None, 3, [], [1, "a"]):
        with pytest.raises(PromptError):
            completion_prompt_tokens(bad, CONFIG)


def test_requested_output_tokens() -> None:
    assert requested_output_tokens({}) is None
    assert requested_output_tokens({"max_tokens": 5}) == 5
    assert requested_output_tokens({"max_tokens": 5, "max_completion_tokens": 2}) == 2
    assert requested_output_tokens({"max_tokens": None, "max_completion_tokens": None}) is None
    # /v1/completions of vLLM and SGLang read only max_tokens (their CompletionRequest has no other).
    assert requested_output_tokens({"max_completion_tokens": 200}, chat=False) is None
    assert requested_output_tokens({"max_tokens": 5, "max_completion_tokens": 2}, chat=False) == 5
    with pytest.raises(PromptError, match="non-negative"):
        requested_output_tokens({"max_tokens": -1})


@pytest.mark.parametrize(("value", "read"), [(5.0, 5), (0.0, 0), (1e3, 1000), ("7", 7), (True, 1)])
def test_output_limits_read_as_the_engines_lax_int(value: object, read: int) -> None:
    """vLLM's and SGLang's `max_tokens: int | None` in pydantic's lax mode: 5.0 is 5 (and "7", true)."""
    assert requested_output_tokens({"max_tokens": value}) == read
    assert requested_output_tokens({"max_completion_tokens": value, "max_tokens": 99}) == read
    assert engine_ints({"n": value})["n"] == read


@pytest.mark.parametrize(("field", "value", "error_type"), [
    ("max_tokens", 5.5, "int_from_float"), ("max_completion_tokens", 0.1, "int_from_float"),
    ("n", 2.5, "int_from_float"), ("max_tokens", "5.5", "int_parsing"), ("max_tokens", [5], "int_type")])
def test_non_integers_fail_as_the_engines_pydantic_model(field: str, value: object, error_type: str) -> None:
    with pytest.raises(FieldValidationError) as caught:
        requested_output_tokens({field: value})
    error = {"type": error_type, "loc": ("body", field)}
    assert [{k: e[k] for k in ("type", "loc")} for e in caught.value.errors] == [error]
    message = str(caught.value)
    assert message.startswith(f"1 validation error:\n  {{'type': '{error_type}', 'loc': ('body', '{field}')")
    assert message.endswith(f" {caught.value.errors}")  # FastAPI's str(exc), then str(exc.errors())


def test_completions_do_not_read_max_completion_tokens() -> None:
    """`CompletionRequest` has no such field: the engines ignore it, even when it is no integer."""
    assert requested_output_tokens({"max_completion_tokens": 5.5, "max_tokens": 3}, chat=False) == 3
    assert engine_ints({"max_completion_tokens": 5.5}, chat=False)["max_completion_tokens"] is None


def test_messages_max_tokens_as_anthropic_messages_request() -> None:
    assert messages_max_tokens({"max_tokens": 5.0}) == 5
    assert messages_max_tokens({"max_tokens": 7}) == 7
    cases = [({"model": "m"}, "missing", "Field required"), ({"max_tokens": None}, "int_type", "valid integer"),
             ({"max_tokens": 5.5}, "int_from_float", "fractional part"),
             ({"max_tokens": 0}, "value_error", "max_tokens must be positive"),
             ({"max_tokens": -3.0}, "value_error", "max_tokens must be positive")]
    for body, error_type, words in cases:
        with pytest.raises(FieldValidationError) as caught:
            messages_max_tokens(body)
        (error,) = caught.value.errors
        assert (error["type"], error["loc"]) == (error_type, ("body", "max_tokens")) and words in error["msg"]
    with pytest.raises(FieldValidationError) as caught:
        messages_max_tokens({"model": "m"})
    assert caught.value.errors[0]["input"] == {"model": "m"}  # FastAPI reports the whole body as input


def test_output_words_are_deterministic_and_multibyte() -> None:
    assert output_text(3) == "Kimi café naïve"
    assert output_token(0) == "Kimi" and output_token(1) == " café"
    assert output_token(len(OUTPUT_WORDS)) == " Kimi"
    widths = {len(ch.encode()) for word in OUTPUT_WORDS for ch in word}
    assert widths == {1, 2, 3, 4}


def test_config_validation() -> None:
    with pytest.raises(ValidationError):
        SimConfig(engine="tgi", max_context_tokens=10)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        SimConfig(engine="vllm", max_context_tokens=10, surprise=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        SimConfig(engine="vllm", max_context_tokens=10, served_model_names=[])
    assert SimConfig(engine="sglang", max_context_tokens=10).model_name == "kimi-k3"


def test_faults_merge_and_chunks() -> None:
    base = SimFaults(fail_status=503, retry_after_s=3)
    merged = base.overridden_by(SimFaults.model_validate({"fail_status": None, "drop_after_chunks": 1}))
    assert (merged.fail_status, merged.retry_after_s, merged.drop_after_chunks) == (None, 3, 1)
    chunks = [b"\xe6\x9d", b"\xb1"]
    assert SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)).raw_chunk_bytes() == chunks
    with pytest.raises(ValidationError):
        SimFaults(raw_stream_chunks=["not base64!"])


def test_global_fail_count_counts_down_and_request_override_does_not() -> None:
    engine = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=10, faults=SimFaults(fail_status=503,
                                                                                       fail_count=1)))
    assert engine.effective_faults(SimFaults.model_validate({"fail_status": 500}))[1] is True
    assert engine.faults.fail_count == 1
    assert engine.effective_faults(None)[1] is True
    assert engine.effective_faults(None)[1] is False
    assert engine.faults.fail_count == 0
    assert engine.effective_faults(SimFaults.model_validate({"fail_status": 500, "fail_count": 0}))[1] is False
    engine.set_faults(SimFaults(fail_status=429))
    assert all(engine.effective_faults(None)[1] for _ in range(3))


def test_kv_usage_model_is_capped() -> None:
    model = ProportionalKVUsage(capacity_tokens=100)
    assert model.usage([]) == 0.0
    assert model.usage([ActiveRequest(30, 10)]) == pytest.approx(0.4)
    assert model.usage([ActiveRequest(90), ActiveRequest(90)]) == 1.0


def test_engine_accounting_and_metrics_registry() -> None:
    engine = SimWorkerState(SimConfig(engine="sglang", max_context_tokens=100))
    active = engine.start_running(20)
    engine.note_generated(active, 5)
    stats = engine.stats()
    assert (stats.running, stats.kv_usage, stats.prompt_tokens_total, stats.generation_tokens_total) == (
        1, pytest.approx(0.25), 20, 5)
    text = generate_latest(engine.registry).decode()
    assert 'sglang:num_running_reqs{model_name="kimi-k3"} 1.0' in text
    assert 'sglang:prompt_tokens_total{model_name="kimi-k3"} 20.0' in text
    engine.stop_running(active, "stop")
    assert engine.stats().running == 0 and engine.stats().finished_by_reason == {"stop": 1}
    other = SimWorkerState(SimConfig(engine="sglang", max_context_tokens=100))
    assert 'sglang:prompt_tokens_total{model_name="kimi-k3"} 0.0' in generate_latest(other.registry).decode()


def test_a_metrics_running_offset_shows_in_metrics_only() -> None:
    """`SimFaults.metrics_running_offset`: an engine that counts its own metrics scrape as running."""
    engine = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=100,
                                      faults=SimFaults(metrics_running_offset=1)))
    assert engine.stats().running == 0
    assert 'vllm:num_requests_running{engine="0",model_name="kimi-k3"} 1.0' in generate_latest(engine.registry).decode()


def test_wait_for_wakes_on_updates_from_another_thread() -> None:
    engine = SimWorkerState(CONFIG)
    record = engine.new_record("/v1/chat/completions", {}, {})

    def later() -> None:
        time.sleep(0.05)
        engine.update(record, aborted=True)

    threading.Thread(target=later).start()
    assert engine.wait_for(lambda: record.aborted, timeout=2) is True
    with pytest.raises(TimeoutError):
        engine.wait_for(lambda: record.completed, timeout=0.05)
    assert engine.records[0].to_json()["aborted"] is True
    assert engine.clear_records() == 1 and engine.records == []


def test_responses_output_limit_reads_as_the_engines_responses_request() -> None:
    assert responses_output_limit({}) is None
    assert responses_output_limit({"max_output_tokens": 7}) == 7
    assert responses_output_limit({"max_output_tokens": 5.0}) == 5
    with pytest.raises(FieldValidationError) as refused:
        responses_output_limit({"max_output_tokens": 5.5})
    assert refused.value.errors[0]["loc"] == ("body", "max_output_tokens")


@pytest.mark.parametrize(("body", "requested", "expected"), [
    ({}, None, (16, "stop")),  # the model stops by itself
    ({}, 8, (8, "length")),
    ({"min_tokens": 40}, None, (40, "stop")),  # its end held back until 40 are out
    ({"min_tokens": 4}, 8, (8, "length")),
    ({"ignore_eos": True}, None, (900, "length")),  # no end: the context's room (vLLM's default max_tokens)
    ({"ignore_eos": True}, 30, (30, "length")),
    ({"min_tokens": 5000}, None, (900, "length")),
])
def test_generated_count_follows_the_sampling_params(body: dict[str, object], requested: int | None,
                                                     expected: tuple[int, str]) -> None:
    assert generated_count(body, requested, 16, 900) == expected


@pytest.mark.parametrize(("body", "requested", "expected"), [
    ({}, 100, (12, "stop")),  # the model's own end comes first
    ({}, 8, (8, "length")),
    ({"min_tokens": 50}, 100, (50, "stop")),
    ({"ignore_eos": True}, 100, (100, "length")),
])
def test_an_eos_after_ends_the_model_under_any_limit(body: dict[str, object], requested: int | None,
                                                      expected: tuple[int, str]) -> None:
    assert generated_count(body, requested, 16, 900, eos_after=12) == expected


def test_min_tokens_over_max_tokens_is_refused() -> None:
    with pytest.raises(PromptError, match="min_tokens must be less than or equal to max_tokens"):
        generated_count({"min_tokens": 9}, 8, 16, 900)
