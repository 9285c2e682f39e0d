"""`loadtest.engine_hits`' workload: conversations rebuilt from prefix-hash blocks, turns as growing
message lists whose earlier turns are exact prefixes of the later ones."""

from __future__ import annotations

import itertools

import pytest

from gateway.auth.cache_isolation import salts
from gateway.auth.keys import KeyRing
from gateway.config import parse_config
from loadtest.engine_hits import (
    DEFAULT_POLICY,
    BookText,
    PolicyRun,
    build_turns,
    conversations,
    gateway_config,
    pick,
    table,
    tenant_key,
)
from loadtest.trace import TraceRequest
from tests.support import SHARED_DATA


def row(index: int, input_length: int, hash_ids: tuple[int, ...], output_length: int = 100) -> TraceRequest:
    return TraceRequest(index, index * 1000, input_length, output_length, hash_ids)


def test_a_request_extending_an_earlier_ones_full_blocks_is_its_next_turn() -> None:
    rows = [row(0, 1500, (0, 1, 2)),           # blocks 0, 1 full, 2 partial
            row(1, 1100, (0, 7, 8)),           # shares only block 0 (the system prompt): a conversation of its own
            row(2, 2000, (0, 1, 3, 4)),        # extends row 0's full blocks (its partial block 2 grew into 3)
            row(3, 2100, (0, 1, 3, 4, 5)),     # extends row 2's: three turns
            row(4, 1800, (0, 1, 3, 9)),        # extends row 2's blocks, but row 2 has a next turn: a branch
            row(5, 600, (0, 7))]               # extends row 1's full blocks (0, 7)
    chains = conversations(rows)
    assert [[r.index for r in chain] for chain in chains] == [[0, 2, 3], [1, 5], [4]]


def test_pick_keeps_conversations_of_enough_turns_under_the_token_cap_in_trace_order() -> None:
    chains = [[row(i, 1000, (0, 1))] * turns for i, turns in enumerate((2, 3, 5, 4))]
    chains[3] = [row(3, 1000, (0, 1)), row(3, 1000, (0, 1)), row(3, 9000, (0, 1))]  # cut before 9,000: 2 turns
    picked = pick(chains, 2, seed=0, min_turns=3, max_turns=4, max_trace_tokens=8192)
    assert [chain[0].index for chain in picked] == [1, 2] and [len(c) for c in picked] == [3, 4]
    with pytest.raises(ValueError, match="only 2 conversations"):
        pick(chains, 3, seed=0, min_turns=3, max_turns=4, max_trace_tokens=8192)


def test_each_turn_repeats_the_previous_turns_messages_and_adds_an_answer_and_a_user_message() -> None:
    texts = BookText(SHARED_DATA / "text" / "books")
    chain = [row(0, 1500, (0, 1, 2), 300), row(1, 2400, (0, 1, 3, 4), 200), row(2, 2500, (0, 1, 3, 4, 5))]
    turns = build_turns(7, chain, 0.5, texts, max_output_tokens=16)
    assert [len(t.messages) for t in turns] == [2, 4, 6]
    assert [m["role"] for m in turns[2].messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    for before, after in itertools.pairwise(turns):
        assert after.messages[:len(before.messages)] == before.messages
    assert [t.max_tokens for t in turns] == [16, 16, 16]
    # Sizes follow the trace at the scale, about 3.45 characters a token: the system prompt is block 0
    # (512 x 0.5 tokens), the first answer 300 x 0.5.
    assert 700 < len(turns[0].messages[0]["content"]) < 1000
    assert 400 < len(turns[1].messages[2]["content"]) < 600
    # Another conversation with the same system block shares the system prompt and nothing else.
    other = build_turns(8, [row(9, 1500, (0, 11, 12), 300)], 0.5, texts, 16)[0]
    assert other.messages[0] == turns[0].messages[0] and other.messages[1] != turns[0].messages[1]


def test_a_longer_shared_system_prompt_is_the_same_text_in_every_conversation() -> None:
    texts = BookText(SHARED_DATA / "text" / "books")
    one = build_turns(1, [row(0, 1500, (0, 1, 2), 300)], 0.5, texts, 16, system_tokens=1024)[0]
    two = build_turns(2, [row(9, 1500, (0, 11, 12), 300)], 0.5, texts, 16, system_tokens=1024)[0]
    assert one.messages[0] == two.messages[0] and one.messages[1] != two.messages[1]
    assert 3000 < len(one.messages[0]["content"]) < 4000  # about 3.45 characters a token


def test_tenants_get_a_key_each_and_the_isolation_asked_for() -> None:
    plain = parse_config(gateway_config(8000, ["http://127.0.0.1:9"], DEFAULT_POLICY), environ={})
    assert not plain.auth.enabled
    isolated = parse_config(gateway_config(8000, ["http://127.0.0.1:9"], DEFAULT_POLICY, 4, "per_key"), environ={})
    assert isolated.auth.enabled and isolated.auth.cache_isolation == "per_key"
    assert KeyRing(isolated.auth.keys).lookup(tenant_key(3)) is not None
    assert len(salts(isolated.auth)) == 4 and len(set(salts(isolated.auth).values())) == 4
    shared = parse_config(gateway_config(8000, ["http://127.0.0.1:9"], "round_robin", 4, "off"), environ={})
    assert shared.auth.enabled and salts(shared.auth) == {}


def test_the_table_names_tenants_and_isolation_only_when_there_are_any() -> None:
    assert "isolation" not in table([PolicyRun(DEFAULT_POLICY)])
    rows = table([PolicyRun(DEFAULT_POLICY, 8, "off"), PolicyRun(DEFAULT_POLICY, 8, "per_key")]).splitlines()
    assert rows[0].startswith("| policy | tenants | cache isolation |")
    assert rows[3].startswith("| default (ttft_cost) | 8 | per_key |")
    assert len({row.count("|") for row in rows}) == 1
