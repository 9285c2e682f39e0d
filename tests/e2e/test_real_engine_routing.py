"""Real engines behind the gateway: pools of llama.cpp workers (n_ctx 256, 2048 and 8192, SmolLM2-135M).

An MT-Bench prompt streams real tokens through the gateway to the openai SDK; a ~360-token book
prompt is routed to the 2048 pool and answered, while the same prompt sent straight to the 256
worker is refused by the engine itself; the same for Chinese, Japanese and Korean prompts, which the
gateway estimates with SmolLM2's own tokens per character (`tests/e2e/smollm2.py`). The boundaries
are at 256/2K tokens so the real prefills stay short on a loaded 2-core machine (a 3,000-token
prefill into the 8K worker took up to 170 s there).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.llamacpp_worker import LlamaCppSettings, LlamaCppWorker
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator
from tests.e2e.smollm2 import SMOLLM2_ESTIMATION
from tests.support import RunningGateway, pool

pytestmark = pytest.mark.engine

# English prose is ~3.8 UTF-8 bytes per SmolLM2 token (measured on the book below): ~360 tokens,
# over the 256-token pool with room to spare, well inside the 2K one.
BOOK_PROMPT_BYTES = 1_350
# These tests are about routing, not health: a real engine busy with a prefill on a loaded 2-core
# machine may take over the default 1 s to answer a probe, and an unhealthy verdict would move the
# request to another pool.
E2E_HEALTH = {"interval": 0.5, "timeout": 10.0}


@pytest.fixture(scope="module")
def workers(worker_2k: LlamaCppWorker) -> Iterator[dict[str, LlamaCppWorker]]:
    """The session's 2K worker (tests/e2e/conftest.py) and an 8K one of this module."""
    large = LlamaCppWorker(LlamaCppSettings(n_ctx=8192)).start()
    try:
        yield {"small": worker_2k, "large": large}
    finally:
        large.stop()


@pytest.fixture
def gateway(workers: dict[str, LlamaCppWorker], start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    return start_gateway([
        pool("cpu-2k", "llamacpp", [workers["small"].url], 2048, default_output_tokens=256),
        pool("cpu-8k", "llamacpp", [workers["large"].url], 8192, default_output_tokens=256),
    ], timeouts={"first_byte_base": 120.0}, estimation=SMOLLM2_ESTIMATION, health=E2E_HEALTH)


def book_prompt(shared_data: Path) -> str:
    text = (shared_data / "text" / "books" / "crime_and_punishment_dostoevsky_garnett.txt").read_text("utf-8")
    excerpt = text[20_000:20_000 + BOOK_PROMPT_BYTES]
    return f"Summarise this passage in one sentence.\n\n{excerpt}"


def test_mt_bench_prompt_streams_real_tokens(gateway: RunningGateway, shared_data: Path) -> None:
    first = json.loads((shared_data / "text" / "mt_bench" / "question.jsonl").read_text().splitlines()[0])
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
            model="Kimi-K3", messages=[{"role": "user", "content": first["turns"][0]}], max_tokens=24,
            temperature=0,  # greedy: sampled, the small model once answered 24 tokens of 9 emoji
            stream=True, stream_options={"include_usage": True}) as response:
        assert response.headers["x-kimi-gateway-pool"] == "cpu-2k"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 5, "tokens must arrive as separate chunks"
    assert len(text.strip()) > 10
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(content_chunks) and usage.prompt_tokens > 20


def test_real_engine_tokens_are_counted_for_a_client_that_did_not_ask_for_usage(gateway: RunningGateway) -> None:
    """llama.cpp honours the usage patch's `stream_options`; its usage chunk never reaches the client."""
    before = gateway.metric('kimi_gateway_tokens_total{kind="completion",pool="cpu-2k"}')
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="Kimi-K3", messages=[{"role": "user", "content": "Hi!"}],
                                                 max_tokens=6, stream=True))
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    counted = gateway.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="cpu-2k"}',
                                      lambda total: total > before) - before
    assert 1 <= counted <= 6  # 6 unless the model ended its answer sooner


def test_long_book_prompt_goes_to_the_larger_pool_and_the_small_engine_refuses_it(
        cjk_gateway: RunningGateway, tiny_worker: LlamaCppWorker, shared_data: Path) -> None:
    prompt = book_prompt(shared_data)
    messages = [{"role": "user", "content": prompt}]
    client = openai.OpenAI(base_url=cjk_gateway.v1, api_key="unused", max_retries=0, timeout=180)
    raw = client.chat.completions.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=16)
    completion = raw.parse()
    assert raw.headers["x-kimi-gateway-pool"] == "cpu-2k"
    assert raw.headers["x-kimi-gateway-attempts"] == "1"
    assert completion.choices[0].message.content
    assert completion.usage is not None and 300 < completion.usage.prompt_tokens < 450

    direct = httpx.post(tiny_worker.url + "/v1/chat/completions", timeout=60,
                        json={"model": "kimi-k3", "messages": messages, "max_tokens": 16})
    assert direct.status_code == 400
    error = direct.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 256
    assert error["n_prompt_tokens"] == completion.usage.prompt_tokens


# Characters of each language that SmolLM2 counts at 330-380 tokens: over a 256-token pool, inside
# the 2K one (a 256/2K boundary keeps the real prefills short on a 2-core machine).
CJK_PROMPT_CHARS = {"zh": 200, "ja": 200, "ko": 160}


def cjk_prompt(lang: str, chars: int) -> str:
    text = (Path(__file__).parents[1] / "data" / "estimate" / f"{lang}.txt").read_text("utf-8")
    return (text * 2)[:chars]


@pytest.fixture(scope="module")
def tiny_worker() -> Iterator[LlamaCppWorker]:
    worker = LlamaCppWorker(LlamaCppSettings(n_ctx=256)).start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def cjk_gateway(workers: dict[str, LlamaCppWorker], tiny_worker: LlamaCppWorker,
                start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    return start_gateway([
        pool("cpu-256", "llamacpp", [tiny_worker.url], 256, default_output_tokens=64),
        pool("cpu-2k", "llamacpp", [workers["small"].url], 2048, default_output_tokens=256),
    ], timeouts={"first_byte_base": 120.0}, estimation=SMOLLM2_ESTIMATION, health=E2E_HEALTH)


@pytest.mark.parametrize("lang", ["zh", "ja", "ko"])
def test_long_cjk_prompt_goes_to_the_larger_pool_first_and_the_small_engine_refuses_it(
        cjk_gateway: RunningGateway, tiny_worker: LlamaCppWorker, lang: str) -> None:
    messages = [{"role": "user", "content": cjk_prompt(lang, CJK_PROMPT_CHARS[lang])}]
    client = openai.OpenAI(base_url=cjk_gateway.v1, api_key="unused", max_retries=0, timeout=180)
    raw = client.chat.completions.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=2)
    completion = raw.parse()
    # The estimate alone chose the 2K pool: no round trip to the 256-token engine first.
    assert (raw.headers["x-kimi-gateway-pool"], raw.headers["x-kimi-gateway-attempts"]) == ("cpu-2k", "1")
    assert completion.usage is not None and 256 < completion.usage.prompt_tokens < 500
    estimated = int(raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
    assert completion.usage.prompt_tokens <= estimated <= 1.4 * completion.usage.prompt_tokens

    direct = httpx.post(tiny_worker.url + "/v1/chat/completions", timeout=60,
                        json={"model": "kimi-k3", "messages": messages, "max_tokens": 2})
    assert direct.status_code == 400 and direct.json()["error"]["type"] == "exceed_context_size_error"


@pytest.mark.parametrize("lang", ["zh", "ja", "ko"])
def test_cjk_prompt_that_fits_stays_in_the_small_pool(cjk_gateway: RunningGateway, lang: str) -> None:
    # Half the small engine's context: the estimate errs high, but not so far as to leave the cheap pool.
    messages = [{"role": "user", "content": cjk_prompt(lang, CJK_PROMPT_CHARS[lang] // 4)}]
    client = openai.OpenAI(base_url=cjk_gateway.v1, api_key="unused", max_retries=0, timeout=180)
    raw = client.chat.completions.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=2)
    completion = raw.parse()
    assert (raw.headers["x-kimi-gateway-pool"], raw.headers["x-kimi-gateway-attempts"]) == ("cpu-256", "1")
    estimated = int(raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
    assert completion.usage is not None and completion.usage.prompt_tokens <= estimated


def test_issue_japanese_prompt_is_estimated_over_the_engines_count(workers: dict[str, LlamaCppWorker]) -> None:
    """The issue's example: ~1,750 Japanese characters that SmolLM2 counts at ~3,050 tokens were
    estimated at 1,615 by bytes (sent to the 2K pool first); with SmolLM2's rates the estimate covers
    the engine's own count (its /tokenize), so routing alone picks the 8K pool."""
    text = cjk_prompt("ja", 1750)
    true = len(httpx.post(workers["large"].url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])
    estimate = TokenEstimator(EstimationConfig.model_validate(SMOLLM2_ESTIMATION)).text_tokens(text)
    assert 2900 < true < 3200
    assert true <= estimate <= 1.3 * true
    assert estimate + 256 > 2048  # over the 2K pool with its output reservation


def test_engine_too_long_answer_moves_the_request_to_the_larger_pool(
        workers: dict[str, LlamaCppWorker], tiny_worker: LlamaCppWorker, start_gateway: Callable[..., RunningGateway],
        shared_data: Path) -> None:
    # A gateway that under-counts (a letter 0.1 token, spaces free) sends the book prompt to the 256 pool;
    # llama.cpp's own `exceed_context_size_error` must move it to the 2K pool before any byte reaches the client.
    gw = start_gateway([
        pool("cpu-256", "llamacpp", [tiny_worker.url], 256, default_output_tokens=64),
        pool("cpu-2k", "llamacpp", [workers["small"].url], 2048, default_output_tokens=256),
    ], estimation={"text_rates": {"latin": 0.1, "whitespace": 0.0, "punctuation": 0.1}, "safety_margin": 1.0},
        timeouts={"first_byte_base": 120.0}, health=E2E_HEALTH)
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=180)
    stream = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": book_prompt(shared_data)}], max_tokens=8, stream=True)
    assert (stream.headers["x-kimi-gateway-pool"], stream.headers["x-kimi-gateway-attempts"]) == ("cpu-2k", "2")
    assert "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kimi_gateway_upstream_attempts_total{outcome="too_long",pool="cpu-256",worker="cpu-256/0"} 1.0' in metrics


def test_client_hang_up_frees_the_engine_slot(gateway: RunningGateway, workers: dict[str, LlamaCppWorker]) -> None:
    body = {"model": "kimi-k3", "stream": True, "max_tokens": 1500,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}
    slots_url = workers["small"].url + "/slots"
    with httpx.stream("POST", gateway.v1 + "/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            assert next(lines) is not None
        assert any(slot["is_processing"] for slot in httpx.get(slots_url).json())
    deadline = time.monotonic() + 5
    while any(slot["is_processing"] for slot in httpx.get(slots_url).json()):
        assert time.monotonic() < deadline, "the engine kept generating after the client hung up"
        time.sleep(0.05)
