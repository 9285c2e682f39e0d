"""Two real llama.cpp workers in one pool behind two gateway PROCESSES sharing one Redis: the turns
of a conversation alternate between the gateways yet all land on the same worker, and the engine's
own `cached_tokens` shows the prefix was reused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import yaml

from gateway.llamacpp_worker import LlamaCppSettings, LlamaCppWorker
from tests.support import free_port, shared_redis_url

pytestmark = pytest.mark.engine

REDIS_URL = shared_redis_url()



@pytest.fixture(scope="module")
def engines() -> Iterator[list[LlamaCppWorker]]:
    workers: list[LlamaCppWorker] = []
    try:
        for _ in range(2):
            workers.append(LlamaCppWorker(LlamaCppSettings(n_ctx=4096, threads=1)).start())
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def gateways(engines: list[LlamaCppWorker], tmp_path: Path) -> Iterator[list[str]]:
    """Two `kimi-gateway serve` processes with the same config and Redis; yields their base URLs."""
    prefix = f"e2e-{uuid.uuid4().hex[:10]}"
    config = {
        "pools": [{"name": "cpu", "engine": "llamacpp", "workers": [w.url for w in engines],
                   "max_context_tokens": 4096, "default_output_tokens": 64, "policy": "prefix_affinity",
                   "policy_params": {"min_match_tokens": 256}}],
        "redis_url": REDIS_URL, "affinity": {"key_prefix": prefix}, "log_level": "warning",
        "shutdown": {"drain_delay": 0},  # the 5 s default held each teardown's SIGTERM for 5 s
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path),
                                           "--port", str(port)], stderr=subprocess.PIPE))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            deadline = time.monotonic() + 20
            while True:
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "gateway exited"
                assert time.monotonic() < deadline, "gateway did not become ready"
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=15)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_conversation_alternating_gateways_reuses_one_workers_cache(gateways: list[str], shared_data: Path) -> None:
    questions = [json.loads(line)["turns"] for line in
                 (shared_data / "text" / "mt_bench" / "question.jsonl").read_text().splitlines()[10:13]]
    book = (shared_data / "text" / "books" / "anna_karenina_tolstoy_garnett.txt").read_text()[5000:8000]
    messages = [{"role": "system", "content": f"Answer briefly. Background reading:\n{book}"}]
    clients = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) for url in gateways]
    seen = []

    def writes(url: str) -> float:  # affinity write batches the gateway has sent to Redis
        lines = httpx.get(url + "/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines
                   if line.startswith('kimi_gateway_redis_seconds_count{op="write"}'))

    for turn, question in enumerate(q for pair in questions for q in pair):
        messages.append({"role": "user", "content": question})
        written_before = writes(gateways[turn % 2])
        raw = clients[turn % 2].chat.completions.with_raw_response.create(
            model="kimi-k3", messages=messages, max_tokens=12)
        completion = raw.parse()
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        seen.append((raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-route-reason"],
                     usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
        deadline = time.monotonic() + 10  # the affinity record is written in the background: wait for it
        while writes(gateways[turn % 2]) <= written_before:
            assert time.monotonic() < deadline, "the affinity record was not written to Redis"
            time.sleep(0.02)
    workers = {worker for worker, *_ in seen}
    assert len(workers) == 1, seen
    assert [reason for _, reason, *_ in seen[1:]] == ["affinity"] * (len(seen) - 1), seen
    for _, _, prompt_tokens, cached in seen[1:]:
        assert cached > 0.7 * prompt_tokens, seen  # the engine reused the shared prefix
