"""vllm-router's `cache_aware` in front of two vLLM sims: it renders each request on the workers
(`/v1/chat/completions/render`, `/v1/completions/render`), keys its prefix tree on the token ids,
and so sends prompts that share a prefix to the same worker, counting prefix hits instead of
`outcome="missing_tokens"`. Skipped when vllm-router is not installed (the `bench` extra; `.ci/run`
installs it, and there a skip is an error)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.serving.server import ThreadedServer
from gateway.sim import SimConfig, sim_server
from tests.support import free_port, stop_process, wait_router_healthy

PREFIXES = {name: f"You are the {name} assistant. " + f"Background on {name}: lorem ipsum dolor. " * 30
            for name in ("alpha", "beta", "gamma")}
"""Three long system prompts (~1.2 KB each); the question after each is a few words, so a repeat
matches far above the router's default cache threshold (0.3)."""


@dataclass
class RouterPair:
    url: str
    metrics_url: str
    render: bool
    """Whether the sims serve the render routes (else the router falls back to `/tokenize`)."""
    sims: list[ThreadedServer]
    proc: subprocess.Popen[bytes]




@pytest.fixture(scope="module", params=["current", "legacy"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterPair]:
    """Two sims of the current vLLM API (render routes) or of the legacy one (only `/tokenize`, the
    router's fallback) behind vllm-router `cache_aware`."""
    if importlib.util.find_spec("vllm_router") is None:
        if os.environ.get("CI"):
            raise RuntimeError("vllm_router is not installed; .ci/run must install it")
        pytest.skip("vllm_router not installed (pip install -c constraints.txt sglang-router vllm-router)")
    sims = [sim_server(SimConfig(engine="vllm", api_version=request.param, max_context_tokens=32_768,
                                   kv_capacity_tokens=100_000)).start()
            for _ in range(2)]
    port, metrics_port = free_port(), free_port()
    log: Path = tmp_path_factory.mktemp("vllm-router") / "router.log"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "HTTP_PROXY", "HTTPS_PROXY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", *(s.url for s in sims),
         "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--worker-startup-check-interval",
         "1", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_router_healthy(proc, url, log, "vllm-router")
        yield RouterPair(url, f"http://127.0.0.1:{metrics_port}/metrics", request.param == "current", sims, proc)
    finally:
        stop_process(proc)
        for sim in sims:
            sim.stop()


def _counter(metrics_url: str, name: str, label: str) -> dict[str, float]:
    """The router's counter `name` summed by the value of `label`."""
    out: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            key = labels.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _workers_of(pair: RouterPair, path: str, marker: str) -> list[int]:
    """Index of the sim that served each request to `path` with `marker` in its body."""
    return [i for i, sim in enumerate(pair.sims)
            for rec in sim.app.engine.records  # type: ignore[attr-defined]
            if rec.path == path and marker in str(rec.body)]


def _chat(pair: RouterPair, name: str, question: str) -> None:
    response = httpx.post(pair.url + "/v1/chat/completions", timeout=10, json={
        "model": "kimi-k3", "max_tokens": 2,
        "messages": [{"role": "system", "content": PREFIXES[name]}, {"role": "user", "content": question}]})
    assert response.status_code == 200, response.text


def _hold_one_request(pair: RouterPair, name: str) -> socket.socket:
    """A chat request of prefix `name` that its worker holds (the sim's `hang_before_headers`
    fault) until the returned socket is closed: the router counts it as that worker's load."""
    body = json.dumps({"model": "kimi-k3", "max_tokens": 2, "x_sim_faults": {"hang_before_headers": True},
                       "messages": [{"role": "system", "content": PREFIXES[name]},
                                    {"role": "user", "content": "held"}]}).encode()
    host, port = pair.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_shared_prefixes_stick_to_their_worker_and_count_as_prefix_hits(pair: RouterPair) -> None:
    held = _hold_one_request(pair, "alpha")
    try:
        deadline = time.monotonic() + 10
        while not (alpha := _workers_of(pair, "/v1/chat/completions", "You are the alpha")):
            assert time.monotonic() < deadline, "the held request reached no worker"
            time.sleep(0.02)  # deadline poll: the record appears on whichever sim the router chose
        _chat(pair, "beta", "question 0")  # a new prefix: the least loaded worker, not alpha's
        (beta,) = _workers_of(pair, "/v1/chat/completions", "You are the beta")
        assert beta != alpha[0]
        for round_ in range(1, 4):  # repeats follow their prefix, though alpha's worker is busier
            _chat(pair, "alpha", f"question {round_}")
            _chat(pair, "beta", f"question {round_}")
        for round_ in range(4):  # the completions render path
            text = httpx.post(pair.url + "/v1/completions", timeout=10, json={
                "model": "kimi-k3", "max_tokens": 2, "prompt": f"{PREFIXES['gamma']} question {round_}"})
            assert text.status_code == 200, text.text
        assert _workers_of(pair, "/v1/chat/completions", "You are the alpha") == [alpha[0]] * 4
        assert _workers_of(pair, "/v1/chat/completions", "You are the beta") == [beta] * 4
        assert len(set(_workers_of(pair, "/v1/completions", "You are the gamma"))) == 1
        decisions = _counter(pair.metrics_url, "vllm_router_prefix_routing_decisions_total", "outcome")
        # How the router got the ids: both workers are asked for each of the 12 decisions.
        inputs = _counter(pair.metrics_url, "vllm_router_kv_routing_inputs_total", "result")
        assert inputs == {"render" if pair.render else "tokenize": 24.0}, inputs
        assert decisions.get("missing_tokens", 0) == 0, decisions
        # 12 decisions: the first request of each prefix misses, the 9 repeats hit.
        assert decisions.get("prefix_hit", 0) == 9 and sum(decisions.values()) == 12, decisions
    finally:
        held.close()
