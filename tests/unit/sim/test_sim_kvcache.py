"""The simulator's prefix-cache model (pure): block hashing, lookup, LRU eviction, pinning, usage."""

from __future__ import annotations

import random
import string

import pytest

from gateway.sim import SimConfig
from gateway.sim.kvcache import (
    CacheLease,
    PrefixCache,
    PromptKey,
    _blake2b_chain,
    _xxh3_chain,
    block_hashes,
    short_digest,
)
from gateway.sim.tokens import chat_prompt_bytes, chat_prompt_tokens, prompt_keys

BT = 4  # tokens per block in the pure-model tests


def _text(n: int, seed: int = 1) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters + " ") for _ in range(n))


def _key(blocks: list[int], extra_tokens: int = 1) -> PromptKey:
    """A prompt of len(blocks) full blocks plus `extra_tokens` (so every block can hit)."""
    return PromptKey(len(blocks) * BT + extra_tokens, tuple(blocks))


# --- hashing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", [_xxh3_chain, _blake2b_chain])
def test_chained_hashes_share_exactly_the_common_prefix(chain: object) -> None:
    a = b"0123456789abcdef" * 8  # 128 bytes = 8 blocks of 16
    b = a[:50] + b"X" + a[51:]  # differs in block 3
    ha = chain(memoryview(a), 16, 8, 7)  # type: ignore[operator]
    hb = chain(memoryview(b), 16, 8, 7)  # type: ignore[operator]
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))
    assert len(set(ha)) == 8  # equal block bytes at different positions hash differently
    assert chain(memoryview(a), 16, 8, 8) != ha  # type: ignore[operator]
    assert all(0 <= h < 2**64 for h in ha)


def test_block_hashes_skip_the_partial_block_and_respect_max_blocks() -> None:
    data = b"x" * 100
    assert len(block_hashes(data, 16)) == 6
    assert block_hashes(data, 16, max_blocks=2) == block_hashes(data, 16)[:2]
    assert block_hashes(data, 16, max_blocks=-1) == []
    assert block_hashes(b"short", 16) == []
    with pytest.raises(ValueError):
        block_hashes(data, 0)
    assert short_digest(b"img") == short_digest(b"img") != short_digest(b"img2")
    assert len(short_digest(b"img")) == 8


def test_hashing_a_50kb_prompt_gives_one_hash_per_full_block() -> None:
    # Its speed (~0.13 ms per 50 KB prompt) is a benchmark figure, not a unit test's business.
    data = _text(50_000).encode()
    hashes = block_hashes(data, 64)
    assert len(hashes) == 781 == len(data) // 64
    assert len(set(hashes)) == len(hashes)  # chained: equal blocks at different places differ


# --- prompt keys -----------------------------------------------------------------------------

CONFIG = SimConfig(engine="vllm", max_context_tokens=100_000, kv_capacity_tokens=10_000)


def test_chat_keys_share_the_common_prefix_only() -> None:
    system = {"role": "system", "content": _text(2000)}
    first = [system, {"role": "user", "content": "question one " * 20}]
    second = [system, {"role": "user", "content": "another question " * 20}]
    k1, k2 = (prompt_keys("chat", {"messages": m}, [chat_prompt_tokens(m, CONFIG)], CONFIG)[0]
              for m in (first, second))
    shared = next(i for i, (a, b) in enumerate(zip(k1.hashes, k2.hashes, strict=False)) if a != b)
    assert shared == (len(b"system\x1e") + 2000) // 64  # 64 bytes = 16 tokens of 4 bytes
    assert len(k1.hashes) * CONFIG.kv_block_tokens <= k1.tokens
    other = [{"role": "system", "content": "Z" + system["content"][1:]}, first[1]]
    k3 = prompt_keys("chat", {"messages": other}, [chat_prompt_tokens(other, CONFIG)], CONFIG)[0]
    assert k3.hashes[0] != k1.hashes[0]


def test_chat_bytes_digest_images_and_tag_other_parts() -> None:
    def msgs(url: str) -> list[dict[str, object]]:
        return [{"role": "user", "content": [{"type": "text", "text": "see"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "input_audio", "input_audio": {}}]}]

    one = chat_prompt_bytes(msgs("data:image/png;base64," + "A" * 10_000))
    assert len(one) < 60 and b"AAAA" not in one and b"input_audio" in one
    assert one != chat_prompt_bytes(msgs("https://x/y.png"))


def test_completion_keys_for_text_and_token_ids() -> None:
    config = CONFIG.model_copy(update={"kv_block_tokens": 2, "bytes_per_token": 1.0})
    (text_key,) = prompt_keys("text", {"prompt": "abcdefg"}, [7], config)
    assert text_key == PromptKey(7, tuple(block_hashes(b"abcdefg", 2, 0, 3)))
    keys = prompt_keys("text", {"prompt": [[1, 2, 3, 4, 5], [1, 2, 9]]}, [5, 3], config)
    assert [len(k.hashes) for k in keys] == [2, 1] and keys[0].hashes[0] == keys[1].hashes[0]
    (single,) = prompt_keys("text", {"prompt": [1, 2, 3, 4]}, [4], config)
    assert single.hashes == keys[0].hashes[:2]
    (huge,) = prompt_keys("text", {"prompt": [2**70, 1]}, [2], config)
    assert huge.hashes == ()


# --- the cache -------------------------------------------------------------------------------


def test_lookup_stops_at_the_first_miss_and_never_counts_the_last_token() -> None:
    cache = PrefixCache(capacity_tokens=1000, block_tokens=BT)
    cache.release(_committed(cache, _key([1, 2, 3])))
    assert cache.lookup(_key([1, 2, 3, 4])) == 3
    assert cache.lookup(_key([1, 9, 3])) == 1
    assert cache.lookup(_key([9, 2, 3])) == 0
    assert cache.lookup(PromptKey(3 * BT, (1, 2, 3))) == 2  # block-aligned: the last block recomputes
    assert cache.lookup(PromptKey(0, ())) == 0


def _committed(cache: PrefixCache, key: PromptKey) -> CacheLease:
    """Acquire `key` and finish its prefill (its blocks cached and pinned)."""
    lease = cache.acquire(key)
    cache.commit(lease)
    return lease


def test_life_cycle_accounting() -> None:
    cache = PrefixCache(capacity_tokens=100, block_tokens=BT)
    key = _key([1, 2, 3], extra_tokens=2)  # 14 tokens: 3 blocks + 2
    lease = cache.acquire(key)
    assert (lease.cached_tokens, cache.private_tokens, cache.cached_tokens) == (0, 14, 0)
    assert cache.usage() == pytest.approx(0.14)
    cache.commit(lease)
    assert (cache.private_tokens, cache.pinned_tokens, cache.cached_tokens) == (2, 12, 12)
    cache.grow(lease, 5)
    assert cache.active_tokens == 19 and cache.usage() == pytest.approx(0.19)
    again = cache.acquire(key)
    assert again.cached_tokens == 12 and cache.pinned_tokens == 12 and cache.private_tokens == 7 + 2
    cache.release(lease)
    cache.release(lease)  # idempotent
    cache.commit(again)
    cache.release(again)
    assert (cache.active_tokens, cache.cached_tokens, cache.used_tokens) == (0, 12, 12)
    assert cache.usage() == 0.0 and cache.usage(include_cache=True) == pytest.approx(0.12)
    with pytest.raises(ValueError):
        cache.acquire(PromptKey(3, (1,)))


def test_lru_eviction_drops_the_oldest_request_tail_first() -> None:
    cache = PrefixCache(capacity_tokens=6 * BT, block_tokens=BT)
    for blocks in ([1, 2, 3], [11, 12, 13]):
        cache.release(_committed(cache, _key(blocks, extra_tokens=0)))
    assert cache.cached_tokens == 6 * BT and cache.evicted_tokens == 0
    cache.lookup(_key([1, 2, 3]))  # a lookup alone does not refresh
    cache.release(_committed(cache, _key([21, 22], extra_tokens=0)))
    assert cache.evicted_tokens == 2 * BT
    assert 1 in cache and 2 not in cache and 3 not in cache  # request 1's tail went first
    assert all(h in cache for h in (11, 12, 13, 21, 22))
    cache.release(_committed(cache, _key([1, 2, 3], extra_tokens=0)))  # hit 1, refresh: now MRU
    assert [h in cache for h in (1, 2, 3, 11, 12, 13)] == [True, True, True, True, False, False]
    assert cache.cached_tokens <= cache.capacity_tokens
    assert cache.clear() == 6 * BT and cache.cached_tokens == 0


def test_blocks_of_running_requests_are_never_evicted() -> None:
    cache = PrefixCache(capacity_tokens=4 * BT, block_tokens=BT)
    running = _committed(cache, _key([1, 2, 3], extra_tokens=0))
    other = _committed(cache, _key([7, 8, 9], extra_tokens=0))  # over capacity: nothing evictable
    assert cache.used_tokens == 6 * BT and cache.usage() == 1.0
    cache.release(other)  # its blocks become evictable and go
    assert cache.used_tokens == 4 * BT and all(h in cache for h in (1, 2, 3))
    assert cache.lookup(_key([1, 2, 3])) == 3
    assert not cache.fits(2 * BT) and cache.fits(BT)
    cache.release(running)
    assert cache.fits(4 * BT)
    assert cache.room_needed(_key([1, 2, 3], extra_tokens=2)) == 2


def test_concurrent_requests_with_the_same_prompt_share_blocks() -> None:
    cache = PrefixCache(capacity_tokens=100, block_tokens=BT)
    a, b = cache.acquire(_key([1, 2])), cache.acquire(_key([1, 2]))  # both miss: neither committed
    cache.commit(a)
    cache.commit(b)
    assert cache.cached_tokens == 2 * BT and cache.private_tokens == 2
    cache.release(a)
    assert 1 in cache and cache.pinned_tokens == 2 * BT
    cache.release(b)
    assert cache.pinned_tokens == 0 and cache.cached_tokens == 2 * BT
