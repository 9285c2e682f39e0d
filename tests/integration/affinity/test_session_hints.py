"""Clients' own cache hints keep a session on one worker when its prompt shares no cached block yet.

Codex CLI sends its conversation id as `prompt_cache_key` in the body and as a `session_id` header
(codex-rs/core/src/client.rs, codex-rs/codex-api/src/requests/headers.rs); Claude Code sends
`metadata.user_id` on /v1/messages. Each turn here is a prompt that shares no block with the one
before it (a new system prompt, a compacted history), so only the hint can say where the session's
earlier turn went: the follow-up must go there (reason `session`). Idle workers' ties rotate, so
without the hint a follow-up goes to another worker every time. The hints are per API key."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from tests.integration.auth.conftest import ALICE_KEY, OPS_KEY, auth_section
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
Turn = Callable[[RunningGateway, str, str], httpx.Headers]


def fresh_prompt() -> str:
    """A prompt no other request shares a block with (it differs from its first byte on)."""
    return uuid.uuid4().hex + " Summarise the design notes so far in one line. " * 40


def chat_key(gw: RunningGateway, hint: str, key: str) -> httpx.Headers:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": fresh_prompt()}], max_tokens=2,
        extra_body={"prompt_cache_key": hint})
    return raw.headers


def codex_responses(gw: RunningGateway, hint: str, key: str) -> httpx.Headers:
    """What Codex sends: the conversation id in `prompt_cache_key` and in a `session_id` header."""
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    raw = client.responses.with_raw_response.create(
        model="kimi-k3", input=fresh_prompt(), max_output_tokens=2, store=False,
        extra_body={"prompt_cache_key": hint}, extra_headers={"session_id": hint})
    return raw.headers


def header_only(name: str) -> Turn:
    def turn(gw: RunningGateway, hint: str, key: str) -> httpx.Headers:
        client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="kimi-k3", messages=[{"role": "user", "content": fresh_prompt()}], max_tokens=2,
            extra_headers={name: hint})
        return raw.headers
    return turn


def claude_code(gw: RunningGateway, hint: str, key: str) -> httpx.Headers:
    client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="kimi-k3", max_tokens=2, messages=[{"role": "user", "content": fresh_prompt()}],
        metadata={"user_id": hint})
    return raw.headers


@pytest.fixture
def three_workers(start_sim: StartSim) -> list[RunningSim]:
    return [start_sim("vllm", max_context_tokens=131072) for _ in range(3)]


def affinity_gateway(start_gateway: StartGateway, sims: list[RunningSim], **settings: object) -> RunningGateway:
    return start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="prefix_affinity")],
                         load={"enabled": False}, **settings)


@pytest.mark.parametrize("turn", [chat_key, codex_responses, header_only("session_id"), header_only("session-id"),
                                  header_only("X-Session-ID"), claude_code],
                         ids=["prompt_cache_key", "codex", "session_id", "session-id", "x-session-id",
                              "metadata.user_id"])
def test_a_turn_without_a_shared_prefix_follows_its_session_hint(three_workers: list[RunningSim],
                                                                 start_gateway: StartGateway, turn: Turn) -> None:
    gw = affinity_gateway(start_gateway, three_workers)
    for session in range(2):
        hint = f"conv-{session}-{uuid.uuid4()}"
        first = turn(gw, hint, "unused")
        assert first["x-kimi-gateway-route-reason"] == "no_match"
        gw.flush_affinity()
        for _ in range(2):
            follow_up = turn(gw, hint, "unused")
            assert (follow_up["x-kimi-gateway-worker"], follow_up["x-kimi-gateway-route-reason"]) == (
                first["x-kimi-gateway-worker"], "session")


def test_two_api_keys_sending_the_same_hint_share_no_affinity(three_workers: list[RunningSim],
                                                               start_gateway: StartGateway) -> None:
    gw = affinity_gateway(start_gateway, three_workers, auth=auth_section())
    hint = f"shared-{uuid.uuid4()}"
    alice = chat_key(gw, hint, ALICE_KEY)
    gw.flush_affinity()
    assert chat_key(gw, hint, OPS_KEY)["x-kimi-gateway-route-reason"] == "no_match"  # not alice's session
    again = chat_key(gw, hint, ALICE_KEY)
    assert (again["x-kimi-gateway-worker"], again["x-kimi-gateway-route-reason"]) == (
        alice["x-kimi-gateway-worker"], "session")


def test_an_oversized_hint_is_no_session_key(three_workers: list[RunningSim], start_gateway: StartGateway) -> None:
    gw = affinity_gateway(start_gateway, three_workers)
    hint = "x" * 513  # over SESSION_HINT_MAX: not kept, not hashed, not routed by
    chat_key(gw, hint, "unused")
    gw.flush_affinity()
    assert chat_key(gw, hint, "unused")["x-kimi-gateway-route-reason"] == "no_match"
