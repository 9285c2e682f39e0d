"""Claude Code's requests hashed as vLLM caches them (issue 37 item 17).

Claude Code opens every request's `system` with an attribution line whose `cc_version` ends in a
fingerprint of the session's first user message (`x-anthropic-billing-header: cc_version=2.1.337.f95;
...`), so two sessions differ there. vLLM leaves that block out of the prompt
(`vllm/entrypoints/anthropic/serving.py` `_convert_system_message`), so its prefix cache serves one
session's tools and system prompt to the next; the gateway's prefix hashes must leave it out too,
while its estimate still counts it (SGLang and llama.cpp prefill it).

`tests/data/agents/claude-code-first-turns.json` holds the first requests of two `claude -p` sessions
of Claude Code 2.1.337 in one project with different prompts, captured as the gateway forwarded them
to a simulated vLLM worker (their temporary paths renamed to `/home/dev`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gateway.affinity.hashing import PrefixHasher, PrefixKey, canonical_message, canonical_prelude
from gateway.affinity.params import AffinityConfig
from gateway.dialects.messages import MessagesDialect
from gateway.routing.features import RoutingRequest
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator
from gateway.sim.anthropic import chat_messages
from tests.support import REPO_ROOT

FIRST_TURNS: list[dict[str, Any]] = json.loads(
    (REPO_ROOT / "tests" / "data" / "agents" / "claude-code-first-turns.json").read_text(encoding="utf-8"))
HASHER = PrefixHasher(AffinityConfig())
ESTIMATOR = TokenEstimator(EstimationConfig())
DIALECT = MessagesDialect()
ATTRIBUTION_PREFIX = "x-anthropic-billing-header"  # Claude Code's (gateway.protocol.anthropic.ATTRIBUTION_PREFIX)


def features(body: dict[str, Any]) -> RoutingRequest:
    return DIALECT.features(DIALECT.validate(copy.deepcopy(body)), "kimi-k3", ESTIMATOR, HASHER, None, None)


def prefix(body: dict[str, Any]) -> PrefixKey:
    key = features(body).prefix
    assert key is not None
    return key


def without_attribution(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as vLLM renders it: its attribution blocks left out."""
    out = copy.deepcopy(body)
    out["system"] = [b for b in out["system"] if not b["text"].startswith(ATTRIBUTION_PREFIX)]
    return out


def shared_blocks(a: PrefixKey, b: PrefixKey) -> int:
    """Leading sampled block hashes `a` and `b` have in common."""
    count = 0
    for x, y in zip(a.hashes, b.hashes, strict=False):
        if x != y:
            break
        count += 1
    return count


def test_the_captured_sessions_differ_in_their_attribution_line_only_up_to_their_prompts() -> None:
    first, second = FIRST_TURNS
    assert [len(b["system"]) for b in FIRST_TURNS] == [3, 3]
    assert all(b["system"][0]["text"].startswith(ATTRIBUTION_PREFIX + ": cc_version=2.1.337.") for b in FIRST_TURNS)
    assert first["system"][0]["text"] != second["system"][0]["text"]  # the per-session fingerprint
    assert first["system"][1:] == second["system"][1:] and first["tools"] == second["tools"]
    assert first["messages"][0]["content"][0] == second["messages"][0]["content"][0]  # the system reminder
    assert first["messages"][0]["content"][1] != second["messages"][0]["content"][1]  # the user's prompt


def test_a_claude_code_request_is_hashed_without_its_attribution_line_as_vllm_renders_it() -> None:
    for body in FIRST_TURNS:
        assert prefix(body) == prefix(without_attribution(body))


def test_two_sessions_share_every_sampled_block_of_their_tools_system_prompt_and_reminder() -> None:
    first, second = (prefix(body) for body in FIRST_TURNS)
    # What vLLM's cache shares between them: the canonical bytes before the user's own prompt.
    twin = DIALECT.validate(without_attribution(FIRST_TURNS[0])).chat
    system, user = twin.messages[0], twin.messages[1]
    assert isinstance(system.content, str) and isinstance(user.content, list)
    reminder = user.content[0].text.encode()  # type: ignore[union-attr]
    tools = len(canonical_prelude((twin.model_extra or {})["tools"]))
    same = tools + len(canonical_message("system", [system.content.encode()])) + len(b"user\x1e") + len(reminder)
    whole = sum(1 for p in first.positions if (p + 1) * first.block_bytes <= same)  # sampled blocks within it
    assert (first.positions[whole - 1] + 1) * first.block_bytes > tools + 4096  # well into the system prompt
    assert shared_blocks(first, second) >= whole


def test_the_attribution_line_is_still_counted_in_the_estimate() -> None:
    for body in FIRST_TURNS:
        assert features(body).prompt_tokens > features(without_attribution(body)).prompt_tokens


def test_attribution_in_a_system_turn_is_left_out_and_a_system_string_is_kept_as_vllm_does() -> None:
    line = f"{ATTRIBUTION_PREFIX}: cc_version=2.1.337.abc; cc_entrypoint=cli;"
    base = {"model": "kimi-k3", "max_tokens": 8, "system": "You are Kimi.",
            "messages": [{"role": "user", "content": "Hi."}]}
    turn = {**base, "messages": [*base["messages"], {"role": "system", "content": line}]}
    blocks = {**base, "messages": [*base["messages"], {"role": "system", "content": [
        {"type": "text", "text": line}, {"type": "text", "text": "Be brief."}]}]}
    kept = {**base, "messages": [*base["messages"], {"role": "system", "content": "Be brief."}]}
    assert prefix(turn) == prefix(base)
    assert prefix(blocks) == prefix(kept)
    assert prefix({**base, "system": line + "\nYou are Kimi."}) != prefix({**base, "system": "You are Kimi."})


def test_the_simulated_vllm_leaves_the_attribution_out_and_the_simulated_sglang_keeps_it() -> None:
    body = FIRST_TURNS[0]
    vllm, sglang = chat_messages(copy.deepcopy(body), sglang=False), chat_messages(copy.deepcopy(body), sglang=True)
    assert vllm[0]["role"] == sglang[0]["role"] == "system"
    assert not vllm[0]["content"].startswith(ATTRIBUTION_PREFIX)
    assert sglang[0]["content"].startswith(ATTRIBUTION_PREFIX)
    assert sglang[0]["content"].endswith(vllm[0]["content"]) and vllm[1:] == sglang[1:]
