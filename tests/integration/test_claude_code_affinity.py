"""A second Claude Code session reaches the worker whose prefix cache holds the first one's system
prompt (issue 37 item 17): Claude Code's attribution line (`system[0]`, per session) is out of the
gateway's prefix hashes, as vLLM leaves it out of the prompt it caches (the simulated vLLM worker
does the same; SGLang keeps it, and so shares nothing across sessions from the system prompt on).

The bodies are real Claude Code 2.1.337 first requests (`tests/data/agents/claude-code-first-turns.json`,
see tests/unit/test_claude_code_prefix.py), sent as Claude Code sends them (streamed, `?beta=true`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from tests.support import REPO_ROOT, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
FIRST_TURNS: list[dict[str, Any]] = json.loads(
    (REPO_ROOT / "tests" / "data" / "agents" / "claude-code-first-turns.json").read_text(encoding="utf-8"))
ATTRIBUTION_PREFIX = "x-anthropic-billing-header"
BLOCK_TOKENS = 16  # the simulator's default KV block


def send(gw: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    with httpx.stream("POST", gw.v1 + "/messages?beta=true", json=body, timeout=30,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        response.read()
    assert response.status_code == 200, response.text
    assert b"message_stop" in response.content
    return response


def test_a_second_claude_code_session_hits_the_first_sessions_system_prompt(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", max_context_tokens=262144, kv_capacity_tokens=400_000) for _ in range(3)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 262144, policy="prefix_affinity")],
                       load={"enabled": False})
    first, second = FIRST_TURNS
    assert first["system"][0]["text"] != second["system"][0]["text"]  # two sessions' attribution lines

    worker = send(gw, first).headers["x-kimi-gateway-worker"]
    gw.flush_affinity()
    answer = send(gw, second)
    assert (answer.headers["x-kimi-gateway-worker"], answer.headers["x-kimi-gateway-route-reason"]) == (
        worker, "affinity")

    index = int(worker.split("/")[1])
    served = sims[index].engine.records
    assert len(served) == 2
    system = "\n".join(b["text"] for b in second["system"] if not b["text"].startswith(ATTRIBUTION_PREFIX))
    assert served[1].cached_tokens >= len(system.encode()) // 4 - BLOCK_TOKENS  # 4 bytes a token in the simulator
    assert all(not s.engine.records for i, s in enumerate(sims) if i != index)
