"""Token accounting, config and fault semantics, and the engine's thread-safe waiting (no HTTP)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from gateway.sim import SimConfig, SimEngine, SimFaults
from gateway.sim.tokens import (
    OUTPUT_WORDS,
    PromptError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    output_text,
    output_token,
    requested_output_tokens,
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
    for bad in (-1, "3", True):
        with pytest.raises(PromptError):
            requested_output_tokens({"max_tokens": bad})


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
    engine = SimEngine(SimConfig(engine="vllm", max_context_tokens=10, faults=SimFaults(fail_status=503,
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
    engine = SimEngine(SimConfig(engine="sglang", max_context_tokens=100))
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
    other = SimEngine(SimConfig(engine="sglang", max_context_tokens=100))
    assert 'sglang:prompt_tokens_total{model_name="kimi-k3"} 0.0' in generate_latest(other.registry).decode()


def test_wait_for_wakes_on_updates_from_another_thread() -> None:
    engine = SimEngine(CONFIG)
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
