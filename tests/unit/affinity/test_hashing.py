"""Prefix hashing: canonical bytes, sampled positions, chained hashes."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gateway.affinity.hashing import PrefixHasher, longest_match, sampled_positions
from gateway.affinity.params import AffinityConfig
from gateway.dialects.chat import chat_features
from gateway.dialects.completions import completion_features
from gateway.dialects.responses import responses_features
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.protocol.responses import ResponsesRequest
from gateway.routing.features import cache_partition
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator

HASHER = PrefixHasher(AffinityConfig())
ESTIMATOR = TokenEstimator(EstimationConfig())


def features(messages: list[dict[str, object]], **extra: object):
    wire = ChatCompletionRequest.model_validate({"model": "kimi-k3", "messages": messages, **extra})
    return chat_features(wire, "kimi-k3", ESTIMATOR, HASHER)


def test_sampled_positions_are_dense_then_geometric() -> None:
    assert sampled_positions(5, 16, 8) == [0, 1, 2, 3, 4]
    positions = sampled_positions(2000, 16, 8)
    assert positions[:16] == list(range(16))
    assert positions[16:24] == list(range(16, 32, 2))
    assert positions[24:32] == list(range(32, 64, 4))
    assert positions[-1] == 1999
    assert len(positions) == 16 + 8 * 7 + 1
    # a shorter prompt's samples are a prefix of a longer one's (but for its own last block)
    assert sampled_positions(700, 16, 8)[:-1] == [p for p in positions if p < 699]


def test_one_million_token_prompt_has_a_bounded_key_count(shared_data: Path) -> None:
    text = (shared_data / "text" / "books" / "war_and_peace_tolstoy_maude.txt").read_text()[:4_000_000]
    f = features([{"role": "user", "content": text}])
    assert f.prompt_tokens > 800_000  # the whole novel (3.3 MB, ~0.77M true tokens): a 1M-token-class prompt
    assert f.prefix is not None and len(f.prefix.hashes) <= 100


def test_shared_prefix_gives_equal_hashes_up_to_the_divergence() -> None:
    base = "The same long system prompt. " * 400   # ~11.6 KB, 5+ blocks
    a = features([{"role": "system", "content": base}, {"role": "user", "content": "question A"}]).prefix
    b = features([{"role": "system", "content": base}, {"role": "user", "content": "question B " * 50}]).prefix
    assert a is not None and b is not None
    shared = [i for i, (x, y) in enumerate(zip(a.hashes, b.hashes, strict=False)) if x == y]
    assert shared == list(range(len(base) // 512))


def test_multi_turn_conversation_extends_the_previous_prefix() -> None:
    turn1 = [{"role": "user", "content": "Tell me about the sea. " * 300}]
    turn2 = [*turn1, {"role": "assistant", "content": "The sea is large. " * 100}, {"role": "user", "content": "More."}]
    k1, k2 = features(turn1).prefix, features(turn2).prefix
    assert k1 is not None and k2 is not None
    owners = ["w1" if h in set(k1.hashes) else None for h in k2.hashes]
    matched = longest_match(k2, owners)
    assert 0.7 < matched["w1"] < 0.8  # turn 1 is 79 % of turn 2; the match stops at a block edge


def test_role_model_and_tools_change_the_hashes() -> None:
    text = "x" * 5000
    user = features([{"role": "user", "content": text}]).prefix
    system = features([{"role": "system", "content": text}]).prefix
    tools = features([{"role": "user", "content": text}],
                     tools=[{"type": "function", "function": {"name": "f"}}]).prefix
    assert user and system and tools
    assert user.hashes[0] != system.hashes[0] != tools.hashes[0]
    wire = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": text}]})
    other_model = chat_features(wire, "other", ESTIMATOR, HASHER).prefix
    assert other_model and other_model.hashes[0] != user.hashes[0]


def test_images_hash_by_digest_not_base64(shared_data: Path) -> None:
    data = base64.b64encode((shared_data / "images" / "astronaut_512.jpg").read_bytes()).decode()
    image = {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}
    message = [{"role": "user", "content": [{"type": "text", "text": "Describe."}, image]}]
    f = features(message)
    assert f.prefix is not None
    assert f.prefix.total_bytes < 100  # the 70 KB of base64 is not in the canonical bytes
    again = features(message).prefix
    assert again == f.prefix


@pytest.mark.parametrize("owners", [[None, None], []])
def test_no_owner_no_match(owners: list[str | None]) -> None:
    key = HASHER.hash(b"a" * 3000, "m")
    assert longest_match(key, owners) == {}


def test_cache_salt_partitions_the_hashes_on_every_api_that_takes_it() -> None:
    """vLLM mixes `cache_salt` into the first block's hash (so every chained block differs) on chat,
    completions and Responses; SGLang keys its radix cache on it and `extra_key`: a salted prompt
    shares no block hash with the same prompt unsalted or under another salt."""
    messages = [{"role": "user", "content": "A shared prompt. " * 400}]
    plain = features(messages).prefix
    salted = features(messages, cache_salt="tenant-a").prefix
    again = features(messages, cache_salt="tenant-a").prefix
    other = features(messages, cache_salt="tenant-b").prefix
    assert plain and salted and other
    assert salted == again
    assert not set(salted.hashes) & set(plain.hashes) and not set(salted.hashes) & set(other.hashes)
    # what the engine judges (an empty salt is vLLM's 400, SGLang's no salt; not a string is an error) is no salt
    assert features(messages, cache_salt="").prefix == plain
    assert features(messages, cache_salt=7).prefix == plain
    # SGLang's extra_key partitions too, apart from the salt (tagged, not concatenated)
    keyed = features(messages, extra_key="b").prefix
    assert keyed and not set(keyed.hashes) & set(plain.hashes)
    assert features(messages, cache_salt="a", extra_key="b").prefix != features(messages, cache_salt="ab").prefix

    text = "A shared completion prompt. " * 400
    completions = [completion_features(CompletionRequest.model_validate({"model": "m", "prompt": text, **salt}),
                                       "m", ESTIMATOR, HASHER).prefix for salt in ({}, {"cache_salt": "s"})]
    responses = [responses_features(ResponsesRequest.model_validate({"model": "m", "input": text, **salt}),
                                    "m", ESTIMATOR, HASHER).prefix for salt in ({}, {"cache_salt": "s"})]
    for unsalted, salted_key in (completions, responses):
        assert unsalted and salted_key and not set(unsalted.hashes) & set(salted_key.hashes)


def test_cache_partition_reads_non_empty_strings_only() -> None:
    assert cache_partition(None) is None and cache_partition({}) is None
    assert cache_partition({"cache_salt": "", "extra_key": None, "other": "x"}) is None
    assert cache_partition({"cache_salt": "s"}) == '{"cache_salt":"s"}'
    assert cache_partition({"cache_salt": "s", "extra_key": "k"}) == '{"cache_salt":"s","extra_key":"k"}'
    # no partition seeds as before: an unsalted prompt keeps its hashes across this change
    assert HASHER.hash(b"x" * 2000, "m", None) == HASHER.hash(b"x" * 2000, "m")
