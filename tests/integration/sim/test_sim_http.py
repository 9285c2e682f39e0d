"""The simulator over real HTTP: vLLM's response shapes, errors per engine, models, health, metrics."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.backends.load import parse_start_time
from gateway.sim.tokens import output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HELLO = [{"role": "user", "content": "hello world"}]  # 11 bytes -> 3 tokens + 4 per message


def test_chat_non_streaming_has_vllm_shape(start_sim: StartSim) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + CHAT, json={"model": "kimi-k3", "messages": HELLO, "max_tokens": 3})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "kimi-k3"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == output_text(3) == "Kimi café naïve"
    assert choice["finish_reason"] == "length"
    # vLLM 0.32: prompt tokens written to the prefix cache (none without a simulated cache), the
    # message without an empty `tool_calls` and with `reasoning`, the server's fingerprint
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0}}
    assert "tool_calls" not in choice["message"] and "reasoning_content" not in choice["message"]
    assert "reasoning" in choice["message"]
    assert body["system_fingerprint"].startswith("vllm-0.32.0-") and len(body["system_fingerprint"]) == 20


def test_sglang_chat_message_keeps_its_fields(start_sim: StartSim) -> None:
    body = httpx.post(start_sim("sglang").url + CHAT, json={"messages": HELLO, "max_tokens": 1}).json()
    message = body["choices"][0]["message"]
    assert message["tool_calls"] == [] and "reasoning_content" in message and body["system_fingerprint"] is None
    # SGLang reports cached tokens only with --enable-cache-report and some cached
    # (srt/entrypoints/openai/usage_processor.py): a cold prompt has none
    assert body["usage"]["prompt_tokens_details"] is None


def test_default_output_tokens_finish_with_stop(start_sim: StartSim) -> None:
    srv = start_sim(default_output_tokens=5)
    body = httpx.post(srv.url + CHAT, json={"messages": HELLO}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["message"]["content"] == output_text(5)


def test_max_completion_tokens_wins_over_max_tokens(start_sim: StartSim) -> None:
    srv = start_sim()
    body = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 9,
                                            "max_completion_tokens": 2}).json()
    assert body["usage"]["completion_tokens"] == 2


def test_chat_stream_events(start_sim: StartSim, sse_payloads: Callable[[bytes], list[Any]]) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 4, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_payloads(resp.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 1 + 4
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert "".join(deltas) == output_text(4)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, None, "length"]
    assert chunks[-1]["choices"][0]["stop_reason"] is None
    # vLLM 0.32 stamps its fingerprint on the chunk that finishes (no usage chunk follows) only
    assert [("system_fingerprint" in c) for c in chunks] == [False] * 4 + [True]


def test_chat_stream_include_usage(start_sim: StartSim, sse_payloads: Callable[[bytes], list[Any]]) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 2, "stream": True,
                                            "stream_options": {"include_usage": True}})
    events = sse_payloads(resp.content)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["usage"] is None and "system_fingerprint" not in c for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2,
                                    "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0}}
    assert usage_chunk["system_fingerprint"].startswith("vllm-")  # the last chunk carries it


def test_text_completions_with_prompt_list(start_sim: StartSim) -> None:
    srv = start_sim()
    body = httpx.post(srv.url + TEXT, json={"prompt": ["abcd", "abcdefgh"], "max_tokens": 2}).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == output_text(2) and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 1 + 2
    assert body["usage"]["completion_tokens"] == 4


def test_text_completions_stream(start_sim: StartSim, sse_payloads: Callable[[bytes], list[Any]]) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + TEXT, json={"prompt": "once upon", "max_tokens": 3, "stream": True})
    events = sse_payloads(resp.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == output_text(3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_tokens_count_text_images_and_messages(start_sim: StartSim) -> None:
    srv = start_sim(image_tokens=100)
    text = "東京 café " * 10
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                     {"type": "input_audio", "input_audio": {"data": "AAAA"}}]},
    ]
    body = httpx.post(srv.url + CHAT, json={"messages": messages, "max_tokens": 1}).json()
    text_bytes = len(b"be brief") + len(text.encode())
    assert body["usage"]["prompt_tokens"] == math.ceil(text_bytes / 4) + 100 + 2 * 4


def test_record_keeps_headers_and_body(start_sim: StartSim) -> None:
    srv = start_sim()
    payload = {"messages": HELLO, "max_tokens": 1, "extra_field": {"kept": True}}
    httpx.post(srv.url + CHAT, json=payload, headers={"X-Session-Id": "abc"})
    records = httpx.get(srv.url + "/sim/requests").json()
    assert len(records) == 1
    record = records[0]
    assert record["body"] == payload
    assert record["headers"]["x-session-id"] == "abc"
    assert record["status"] == 200 and record["completed"] and not record["aborted"]
    assert record["prompt_tokens"] == 7 and record["completion_tokens_sent"] == 1
    assert record["received_at"] <= record["first_byte_at"] <= record["finished_at"]
    assert httpx.delete(srv.url + "/sim/requests").json() == {"cleared": 1}
    assert srv.app.engine.records == []


def test_unknown_model_vllm(start_sim: StartSim) -> None:
    srv = start_sim(served_model_names=["kimi-k3", "kimi"])
    ok = httpx.post(srv.url + CHAT, json={"model": "kimi", "messages": HELLO, "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["model"] == "kimi-k3"
    resp = httpx.post(srv.url + CHAT, json={"model": "gpt-4", "messages": HELLO, "stream": True})
    assert resp.status_code == 404
    assert resp.json() == {"error": {"message": "The model `gpt-4` does not exist. Valid aliases: kimi-k3, kimi.",
                                     "type": "NotFoundError", "param": "model", "code": 404}}


def test_unknown_model_vllm_legacy_and_sglang(start_sim: StartSim) -> None:
    legacy = start_sim(api_version="legacy")
    resp = httpx.post(legacy.url + TEXT, json={"model": "X", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json() == {"object": "error", "message": "The model `X` does not exist.",
                           "type": "NotFoundError", "param": None, "code": 404}
    sglang = start_sim(engine="sglang")
    resp = httpx.post(sglang.url + CHAT, json={"model": "X", "messages": HELLO})
    assert resp.status_code == 400
    assert resp.json() == {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                           "message": "The model `X` does not exist. The served model name is `kimi-k3`."}


# prompt of 400 bytes -> 100 tokens + 4 (one message) = 104 prompt tokens; window 100
LONG = [{"role": "user", "content": "x" * 400}]

CONTEXT_CASES = [
    ("vllm", "current", {"error": {
        "message": "This model's maximum context length is 100 tokens. However, your prompt contains at least "
                   "101 input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                   "length of the input prompt. (parameter=input_tokens, value=101)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}),
    ("ascend", "current", {"error": {
        "message": "This model's maximum context length is 100 tokens. However, your prompt contains at least "
                   "101 input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                   "length of the input prompt. (parameter=input_tokens, value=101)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}),
    ("vllm", "legacy", {
        "object": "error",
        "message": "This model's maximum context length is 100 tokens. However, you requested 104 tokens in the "
                   "messages, Please reduce the length of the messages.",
        "type": "BadRequestError", "param": None, "code": 400}),
    ("sglang", "current", {
        "object": "error",
        "message": "The input (104 tokens) is longer than the model's context length (100 tokens).",
        "type": "BadRequestError", "param": None, "code": 400}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("engine", "api_version", "expected"), CONTEXT_CASES)
def test_context_error_wording_per_engine(start_sim: StartSim, engine: str, api_version: str,
                                          expected: dict[str, Any], stream: bool) -> None:
    srv = start_sim(engine=engine, api_version=api_version, max_context_tokens=100)
    resp = httpx.post(srv.url + CHAT, json={"messages": LONG, "stream": stream})
    assert resp.status_code == 400
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == expected
    record = srv.app.engine.records[-1]
    assert record.status == 400 and record.prompt_tokens == 104
    assert srv.app.engine.stats().prompt_tokens_total == 0


def test_context_error_with_max_tokens_per_engine(start_sim: StartSim) -> None:
    """54 prompt tokens + max_tokens 60 on a context of 100: vLLM 0.32 serves it with the output
    shortened to the 46 tokens left (`get_max_tokens`; it refused it before its renderer stopped taking
    max_tokens off the prompt's room), vLLM <= 0.9 and SGLang refuse it."""
    body = {"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 60}  # 54 + 60 > 100
    vllm = start_sim(max_context_tokens=100)
    served = httpx.post(vllm.url + CHAT, json=body)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["finish_reason"] == "length"
    usage = served.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (54, 46)
    over = httpx.post(vllm.url + CHAT, json={**body, "max_tokens": 101})
    assert over.status_code == 400 and over.json()["error"] == {
        "message": "max_tokens=101 cannot be greater than max_model_len=100. Please request fewer output tokens. "
                   "(parameter=max_tokens, value=101)", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    legacy = start_sim(max_context_tokens=100, api_version="legacy")
    assert httpx.post(legacy.url + CHAT, json=body).json()["message"] == (
        "This model's maximum context length is 100 tokens. However, you requested 114 tokens (54 in the "
        "messages, 60 in the completion). Please reduce the length of the messages or completion.")
    sglang = start_sim(engine="sglang", max_context_tokens=100)
    assert httpx.post(sglang.url + CHAT, json=body).json()["message"] == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. You requested a total "
        "of 114 tokens: 54 tokens from the input messages and 60 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit.")


def test_exact_fit_both_serve_one_more_sglang_refuses(start_sim: StartSim) -> None:
    """54 + 46 == 100: served by both (SGLang 0.5.23 refuses only a total over its context, and its
    scheduler then stops 2 tokens short of it); 54 + 47: vLLM shortens it, SGLang refuses it."""
    body = {"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 46}  # 54 + 46 == 100
    assert httpx.post(start_sim(max_context_tokens=100).url + CHAT, json=body).status_code == 200
    sglang = start_sim(engine="sglang", max_context_tokens=100)
    exact = httpx.post(sglang.url + CHAT, json=body)
    assert exact.status_code == 200 and exact.json()["usage"]["completion_tokens"] == 44
    assert httpx.post(sglang.url + CHAT, json={**body, "max_tokens": 47}).status_code == 400
    assert httpx.post(start_sim(max_context_tokens=100).url + CHAT, json={**body, "max_tokens": 47}).status_code == 200


def test_vllm_refuses_a_prompt_that_fills_its_context(start_sim: StartSim) -> None:
    """A prompt of exactly max_model_len leaves vLLM 0.32 0 output tokens, which its SamplingParams refuse."""
    full = [{"role": "user", "content": "x" * 384}]  # 96 + 4 == 100
    refused = httpx.post(start_sim(max_context_tokens=100).url + CHAT, json={"messages": full})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")


def test_no_output_limit_runs_to_the_end_of_the_context_without_a_natural_end(start_sim: StartSim) -> None:
    """With `default_output_tokens` None the simulated model never ends by itself, so a request without a
    limit generates what the context leaves, as vLLM's default max_tokens (max_model_len - prompt) lets it."""
    srv = start_sim(max_context_tokens=100, default_output_tokens=None)
    answer = httpx.post(srv.url + CHAT, json={"messages": HELLO}).json()
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 100


def test_sglang_legacy_stream_reports_context_error_in_band(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", api_version="legacy", max_context_tokens=100)
    resp = httpx.post(srv.url + CHAT, json={"messages": LONG, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.content == (
        b'data: {"error": {"object": "error", "message": "The input (104 tokens) is longer than the model\'s '
        b'context length (100 tokens).", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
        b"data: [DONE]\n\n")
    assert httpx.post(srv.url + CHAT, json={"messages": LONG}).status_code == 400


def test_bad_json_and_bad_prompt(start_sim: StartSim) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert httpx.post(srv.url + CHAT, json={"messages": []}).status_code == 400
    assert httpx.post(srv.url + TEXT, json={"prompt": 5}).status_code == 400
    assert httpx.get(srv.url + "/nope").status_code == 404
    assert httpx.get(srv.url + CHAT).status_code == 405


@pytest.mark.parametrize(("field", "value", "message", "param"), [
    ("temperature", -1, "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
     "temperature"),
    ("temperature", 2.5, "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)", "temperature"),
    ("top_p", 0, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
    ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3.0.", None),
    ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2], got -2.5.", None),
    ("repetition_penalty", 0, "repetition_penalty must be greater than zero, got 0.0.", None),
    ("top_k", -2, "top_k must be 0 (disable), or at least 1, got -2.", None),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5.", None),
])
def test_vllm_refuses_sampling_parameters_out_of_range(start_sim: StartSim, field: str, value: float, message: str,
                                                       param: str | None) -> None:
    """vLLM's `SamplingParams._verify_args` (vllm/sampling_params.py): 400 `BadRequestError`, `param` the
    parameter its error names; on chat, completions and Responses alike. SGLang's checks are not imitated."""
    srv = start_sim()
    for path, body in ((CHAT, {"messages": HELLO}), (TEXT, {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
        refused = httpx.post(srv.url + path, json={**body, "max_tokens": 2, field: value})
        assert refused.status_code == 400, path
        assert refused.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    assert not [r for r in srv.engine.records if r.completion_tokens_sent]  # refused before generating
    assert httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 1, field: None}).status_code == 200
    legacy = httpx.post(start_sim(api_version="legacy").url + CHAT, json={"messages": HELLO, field: value}).json()
    assert (legacy["message"], legacy["param"]) == (message.split(" (parameter=")[0], None)
    assert httpx.post(start_sim(engine="sglang").url + CHAT, json={"messages": HELLO, "max_tokens": 1,
                                                                  field: value}).status_code == 200


def test_models_and_health(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", served_model_names=["kimi-k3", "k3"], max_context_tokens=524288)
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["kimi-k3", "k3"]
    assert all(m["object"] == "model" and m["owned_by"] == "sglang" and m["max_model_len"] == 524288
               for m in models["data"])
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert srv.app.engine.health_checks == 1


def _metrics(url: str) -> dict[str, tuple[str, float]]:
    """`name{labels}` -> (labels, value) of a Prometheus text page, keyed by metric name + labels."""
    out: dict[str, tuple[str, float]] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = (key, float(value))
    return out


@pytest.mark.parametrize(("engine", "api_version", "names"), [
    ("vllm", "current", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                         "vllm:request_success_total"]),
    ("ascend", "current", ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"]),
    ("vllm", "legacy", ["vllm:gpu_cache_usage_perc"]),
    ("sglang", "current", ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                           "sglang:prompt_tokens_total", "sglang:generation_tokens_total"]),
])
def test_metric_names_per_engine(start_sim: StartSim, engine: str, api_version: str, names: list[str]) -> None:
    srv = start_sim(engine=engine, api_version=api_version)
    httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 2})
    text = httpx.get(srv.url + "/metrics").text
    for name in names:
        assert f"\n{name}{{" in text, name
    assert 'model_name="kimi-k3"' in text
    metrics = _metrics(srv.url)
    prefix = "vllm" if engine != "sglang" else "sglang"
    generated = [v for k, (_, v) in metrics.items() if k.startswith(f"{prefix}:generation_tokens_total")]
    assert generated == [2.0]


def test_a_vllm_sim_tells_its_own_process_start_time_and_a_sglang_one_none(start_sim: StartSim) -> None:
    """vLLM with one API server has prometheus_client's `process_start_time_seconds`; SGLang's
    multiprocess registry has not (gateway/sim/dialects.py `MetricNames.process_start_time`)."""
    earliest = time.time()
    first, second = start_sim("vllm"), start_sim("vllm")
    started = [parse_start_time(httpx.get(s.url + "/metrics").text) for s in (first, second)]
    assert all(t is not None and earliest <= t <= time.time() for t in started), started
    assert started[0] != started[1]  # each engine its own
    assert started[0] == parse_start_time(httpx.get(first.url + "/metrics").text)  # and it stays
    assert parse_start_time(httpx.get(start_sim("sglang").url + "/metrics").text) is None


def test_running_rises_while_a_slow_request_is_in_flight(start_sim: StartSim) -> None:
    srv = start_sim(ttft_s=0.4, max_context_tokens=1000)
    engine = srv.app.engine
    thread = threading.Thread(target=lambda: httpx.post(srv.url + CHAT, json={"messages": HELLO,
                                                                               "max_tokens": 1}))
    thread.start()
    engine.wait_for(lambda: engine.stats().running == 1, timeout=2)
    metrics = _metrics(srv.url)
    assert metrics['vllm:num_requests_running{engine="0",model_name="kimi-k3"}'][1] == 1.0
    assert metrics['vllm:kv_cache_usage_perc{engine="0",model_name="kimi-k3"}'][1] == pytest.approx(7 / 1000)
    thread.join(5)
    assert engine.stats().running == 0
    assert _metrics(srv.url)['vllm:num_requests_running{engine="0",model_name="kimi-k3"}'][1] == 0.0


def test_max_num_seqs_queues_requests_as_waiting(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", ttft_s=0.3, max_num_seqs=1)
    engine = srv.app.engine
    threads = [threading.Thread(target=lambda: httpx.post(srv.url + CHAT, json={"messages": HELLO,
                                                                                "max_tokens": 1}))
               for _ in range(2)]
    for t in threads:
        t.start()
    engine.wait_for(lambda: engine.stats().running == 1 and engine.stats().waiting == 1, timeout=2)
    assert _metrics(srv.url)['sglang:num_queue_reqs{model_name="kimi-k3"}'][1] == 1.0
    for t in threads:
        t.join(5)
    assert engine.stats().waiting == 0 and engine.stats().finished_by_reason == {"length": 2}


@pytest.mark.parametrize("headers_after_prefill", [False, True])
def test_stream_timing(start_sim: StartSim, headers_after_prefill: bool) -> None:
    srv = start_sim(ttft_s=0.3, tpot_s=0.05, stream_headers_after_prefill=headers_after_prefill)
    start = time.monotonic()
    arrivals: list[float] = []
    with httpx.stream("POST", srv.url + CHAT, json={"messages": HELLO, "max_tokens": 3, "stream": True}) as resp:
        headers_at = time.monotonic() - start
        for _ in resp.iter_raw():
            arrivals.append(time.monotonic() - start)
    if headers_after_prefill:
        assert headers_at >= 0.28
    else:
        assert headers_at < 0.2
    assert arrivals[0] >= 0.28
    assert arrivals[-1] >= 0.3 + 2 * 0.05 - 0.02
    record = srv.app.engine.records[-1]
    assert record.first_byte_at is not None and record.first_byte_at - record.received_at >= 0.28


def test_non_streaming_waits_ttft_plus_tpot(start_sim: StartSim) -> None:
    srv = start_sim(ttft_s=0.1, tpot_s=0.05)
    start = time.monotonic()
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 4})
    assert resp.status_code == 200
    assert time.monotonic() - start >= 0.1 + 3 * 0.05 - 0.02


def test_output_is_valid_utf8_json(start_sim: StartSim) -> None:
    srv = start_sim()
    raw = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 16}).content
    assert "東京".encode() in raw and "🚀".encode() in raw  # raw UTF-8, not \\u escapes
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == output_text(16)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_integral_float_limits_are_integers_as_in_the_engines(start_sim: StartSim, engine: str) -> None:
    """JSON's 5.0 passes the engines' lax `int` fields: 5 tokens generated, n read as 1."""
    srv = start_sim(engine)
    chat = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_tokens": 5.0, "n": 1.0})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
    assert chat.json()["choices"][0]["message"]["content"] == output_text(5)
    newer = httpx.post(srv.url + CHAT, json={"messages": HELLO, "max_completion_tokens": 2.0, "max_tokens": 9})
    assert newer.json()["usage"]["completion_tokens"] == 2
    text = httpx.post(srv.url + TEXT, json={"prompt": "once upon", "max_tokens": 3.0})
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("engine", "api_version", "nested"), [
    ("vllm", "current", True), ("vllm", "legacy", False), ("sglang", "current", False)])
@pytest.mark.parametrize(("path", "field"), [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"),
                                             (CHAT, "n"), (TEXT, "max_tokens")])
def test_non_integral_limits_get_the_engines_validation_error(start_sim: StartSim, engine: str, api_version: str,
                                                              nested: bool, path: str, field: str) -> None:
    """5.5 fails pydantic (`int_from_float`); the engines' RequestValidationError handler answers
    400 "Bad Request", naming the field in the message's `loc`. vLLM 0.32 (`validation_exception_handler`,
    vllm/entrypoints/serve/exception_handling/handlers/validation.py) joins the `loc` with dots, echoes the
    input as text and sets `param` to that `loc`; the legacy vLLM and SGLang say FastAPI's `str(exc)`, param null."""
    srv = start_sim(engine, api_version=api_version)
    body: dict[str, Any] = {"messages": HELLO} if path == CHAT else {"prompt": "once upon"}
    response = httpx.post(srv.url + path, json={**body, field: 5.5})
    assert response.status_code == 400
    error = response.json()
    inner = error["error"] if nested else error
    assert (set(error) == {"error"}) is nested and (error.get("object") == "error") is not nested
    msg = "'msg': 'Input should be a valid integer, got a number with a fractional part'"
    if nested:  # vLLM 0.32
        assert (inner["type"], inner["param"], inner["code"]) == ("Bad Request", f"body.{field}", 400)
        assert inner["message"] == (f"1 validation error:\n  {{'type': 'int_from_float', 'loc': 'body.{field}', "
                                    f"{msg}, 'input': '5.5'}}")
    else:
        assert (inner["type"], inner["param"], inner["code"]) == ("Bad Request", None, 400)
        assert inner["message"].startswith(f"1 validation error:\n  {{'type': 'int_from_float', "
                                           f"'loc': ('body', '{field}'), {msg}, 'input': 5.5}}")
