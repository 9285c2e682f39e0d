"""A simulated worker's KV cache with automatic prefix caching (pure; no I/O, no locking).

Model (after vLLM's automatic prefix caching and SGLang's radix cache, at block granularity):

- A prompt is a byte string standing in for its token sequence (see `gateway.sim.tokens.prompt_key`),
  cut into blocks of `block_bytes` bytes = `block_tokens` tokens. Block i of a prompt is named by a
  chained hash h_i = H(h_{i-1} || block_i), so equal hashes mean equal prompts up to the end of the
  block. H is xxh3_64 with the previous hash as seed when `xxhash` is installed, else blake2b with
  an 8-byte digest (~4x slower). The chain's seed h_{-1} comes from the model name and the
  request's cache partition (its `cache_salt`, and on SGLang its `extra_key`:
  `SimWorkerState.cache_partition`), so differently salted prompts share no block, as in vLLM,
  which mixes the salt into the first block's hash.
- A request's cached tokens = leading blocks found in the cache x `block_tokens`, stopping at the
  first miss. Like vLLM, the last prompt token is always recomputed: only blocks that end before
  it can hit, so a fully cached, block-aligned prompt still prefills its last block.
- Memory is counted in tokens: every cached block holds `block_tokens`; a running request also
  holds private tokens (its prompt until the prefill commits it, the tail of its prompt that does
  not fill a block, and its generated tokens). When the total exceeds `capacity_tokens`, the least
  recently used unpinned blocks are evicted; blocks used by running requests are pinned (reference
  counted) and never evicted, so the total may overshoot while running requests need the room.
- A finished request's blocks are unpinned in reverse order (its tail first), as vLLM frees them,
  so eviction eats a prefix from its end and the shared beginning of a prompt survives longest.
- Usage as the engines report it (`vllm:kv_cache_usage_perc`: 1 - free blocks / blocks, where free
  blocks include cached blocks no request uses; `sglang:token_usage`: used tokens excluding the
  evictable radix cache) = (pinned block tokens + private tokens) / capacity, capped at 1.0.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

try:  # xxhash is optional: much faster than blake2b for ~800 blocks of a 50 KB prompt
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None  # type: ignore[assignment]

_MASK64 = (1 << 64) - 1


def _blake2b_chain(data: memoryview, block_bytes: int, n_blocks: int, seed: int) -> list[int]:
    hashes: list[int] = []
    h = seed
    for i in range(n_blocks):
        digest = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        digest.update(data[i * block_bytes:(i + 1) * block_bytes])
        h = int.from_bytes(digest.digest(), "little")
        hashes.append(h)
    return hashes


def _xxh3_chain(data: memoryview, block_bytes: int, n_blocks: int, seed: int) -> list[int]:
    digest: Callable[..., int] = xxhash.xxh3_64_intdigest
    hashes: list[int] = []
    h = seed
    for i in range(n_blocks):
        h = digest(data[i * block_bytes:(i + 1) * block_bytes], h)
        hashes.append(h)
    return hashes


def block_hashes(data: bytes, block_bytes: int, seed: int = 0, max_blocks: int | None = None) -> list[int]:
    """Chained hashes (unsigned 64-bit ints) of the full `block_bytes`-byte blocks of `data`.

    A trailing partial block is not hashed. `max_blocks` bounds the count; `seed` is h_{-1}.
    Cost: one hash call per block (~0.3 µs with xxhash), no per-byte or per-token Python work.
    """
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    n_blocks = len(data) // block_bytes
    if max_blocks is not None:
        n_blocks = min(n_blocks, max(0, max_blocks))
    view = memoryview(data)
    seed &= _MASK64
    if xxhash is not None:
        return _xxh3_chain(view, block_bytes, n_blocks, seed)
    return _blake2b_chain(view, block_bytes, n_blocks, seed)  # pragma: no cover - without xxhash


def short_digest(data: bytes) -> bytes:
    """An 8-byte digest of `data` (stands in for an image's tokens: equal images hash alike)."""
    if xxhash is not None:
        return xxhash.xxh3_64_digest(data)
    return hashlib.blake2b(data, digest_size=8).digest()  # pragma: no cover - without xxhash


def seed_for(name: str) -> int:
    """A stable 64-bit seed from a name (e.g. the served model), so chains differ per model."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class PromptKey:
    """One prompt as the cache sees it: its length in tokens and its full blocks' chained hashes.

    `hashes` covers at most `tokens // block_tokens` blocks (a caller may pass fewer, e.g. when
    images make the byte stand-in shorter than the token count).
    """

    tokens: int
    hashes: tuple[int, ...] = ()


@dataclass(eq=False, slots=True)
class CacheLease:
    """What one running prompt holds in the cache: pinned blocks and private tokens.

    `cached_tokens` is the prefix found in the cache at admission (tokens); `pinned` the hashes
    this lease references (hits first, then its own blocks once committed), in prompt order.
    """

    key: PromptKey
    cached_tokens: int
    pinned: list[int] = field(default_factory=list)
    private_tokens: int = 0
    committed: bool = False
    released: bool = False


class PrefixCache:
    """The cache of one worker: `capacity_tokens` of KV memory in blocks of `block_tokens` tokens.

    Not thread-safe: the owning engine serialises calls. Typical life of a request:
    `lookup` / `fits` while queued, `acquire` at admission (pins the hit prefix), `commit` after
    the prefill (caches and pins all its full blocks), `grow` per generated token, `release` at
    the end (unpins; blocks stay cached until evicted).
    """

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if capacity_tokens <= 0 or block_tokens <= 0:
            raise ValueError("capacity_tokens and block_tokens must be positive")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self._free: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no running request uses, least recently used first (evictable)."""
        self._pinned: dict[int, int] = {}
        """Cached blocks in use: hash -> number of leases referencing it."""
        self._private_tokens = 0
        self.evicted_tokens = 0
        """Tokens evicted since creation (a counter; blocks x `block_tokens`)."""

    # --- read-only views ---------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        """Tokens held in cached blocks, pinned or not."""
        return (len(self._free) + len(self._pinned)) * self.block_tokens

    @property
    def pinned_tokens(self) -> int:
        """Tokens in cached blocks that running requests use (not evictable)."""
        return len(self._pinned) * self.block_tokens

    @property
    def private_tokens(self) -> int:
        """Tokens running requests hold outside cached blocks (uncommitted prompt, tails, output)."""
        return self._private_tokens

    @property
    def used_tokens(self) -> int:
        """All tokens in KV memory: cached blocks + private tokens (may exceed the capacity only
        while running requests pin more than it)."""
        return self.cached_tokens + self._private_tokens

    @property
    def active_tokens(self) -> int:
        """Tokens that cannot be evicted: pinned blocks + private tokens."""
        return self.pinned_tokens + self._private_tokens

    def usage(self, include_cache: bool = False) -> float:
        """KV usage in [0, 1]: active tokens / capacity (the engines' definition), or with
        `include_cache` all used tokens (evictable cached blocks included) / capacity."""
        held = self.used_tokens if include_cache else self.active_tokens
        return min(1.0, held / self.capacity_tokens)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._pinned or block_hash in self._free

    def lookup(self, key: PromptKey) -> int:
        """Leading blocks of `key` that are cached (stops at the first miss; the block holding the
        last prompt token never counts, as vLLM always recomputes that token)."""
        limit = min(len(key.hashes), max(0, key.tokens - 1) // self.block_tokens)
        pinned, free = self._pinned, self._free
        hits = 0
        for block_hash in key.hashes[:limit]:
            if block_hash not in pinned and block_hash not in free:
                break
            hits += 1
        return hits

    def room_needed(self, key: PromptKey) -> int:
        """Tokens `key` would add to the non-evictable total if admitted now (its uncached part)."""
        return key.tokens - self.lookup(key) * self.block_tokens

    def pin_cost(self, key: PromptKey) -> int:
        """Tokens `key` would add to the non-evictable total if admitted now: its uncached part plus
        its cached blocks nobody pins (they leave the evictable pool, as vLLM counts touched free
        blocks against its free-block budget). `room_needed` leaves the latter out."""
        hits = self.lookup(key)
        pinned = self._pinned
        shared = sum(1 for block_hash in key.hashes[:hits] if block_hash in pinned)
        return key.tokens - shared * self.block_tokens

    def fits(self, extra_tokens: int) -> bool:
        """Whether `extra_tokens` more non-evictable tokens fit beside those held now."""
        return self.active_tokens + extra_tokens <= self.capacity_tokens

    # --- request life cycle ------------------------------------------------------------------

    def acquire(self, key: PromptKey) -> CacheLease:
        """Admit `key`: pin its cached prefix; the rest of the prompt becomes private tokens."""
        if len(key.hashes) * self.block_tokens > key.tokens:
            raise ValueError("a PromptKey has more full blocks than its tokens fill")
        hits = self.lookup(key)
        pinned = list(key.hashes[:hits])
        self._pin_all(pinned)
        cached = hits * self.block_tokens
        lease = CacheLease(key, cached, pinned, key.tokens - cached)
        self._private_tokens += lease.private_tokens
        self._evict()
        return lease

    def commit(self, lease: CacheLease) -> None:
        """The prefill finished: cache (and pin) every full block of the prompt."""
        if lease.committed or lease.released:
            return
        lease.committed = True
        new_blocks = lease.key.hashes[len(lease.pinned):]
        self._pin_all(new_blocks)
        lease.pinned.extend(new_blocks)
        moved = len(new_blocks) * self.block_tokens
        lease.private_tokens -= moved
        self._private_tokens -= moved
        self._evict()

    def grow(self, lease: CacheLease, tokens: int = 1) -> None:
        """`tokens` generated tokens join the request's private tokens (may evict)."""
        if lease.released:
            return
        lease.private_tokens += tokens
        self._private_tokens += tokens
        self._evict()

    def release(self, lease: CacheLease) -> None:
        """The request ended: drop its private tokens and unpin its blocks, tail first."""
        if lease.released:
            return
        lease.released = True
        self._private_tokens -= lease.private_tokens
        lease.private_tokens = 0
        self._unpin_all(reversed(lease.pinned))
        lease.pinned.clear()
        self._evict()

    def clear(self) -> int:
        """Drop every unpinned block (not counted as evictions); returns the tokens dropped."""
        dropped = len(self._free) * self.block_tokens
        self._free.clear()
        return dropped

    # --- internals ---------------------------------------------------------------------------

    def _pin_all(self, hashes: Iterable[int]) -> None:
        """Reference each block (cached or new); loops inlined: ~800 blocks per 50 KB prompt."""
        pinned, free = self._pinned, self._free
        for block_hash in hashes:
            count = pinned.get(block_hash)
            if count is None:
                free.pop(block_hash, None)
                pinned[block_hash] = 1
            else:
                pinned[block_hash] = count + 1

    def _unpin_all(self, hashes: Iterable[int]) -> None:
        """Drop a reference to each block; unreferenced blocks go to the most recently used end."""
        pinned, free = self._pinned, self._free
        for block_hash in hashes:
            count = pinned.get(block_hash, 0)
            if count > 1:
                pinned[block_hash] = count - 1
            elif count == 1:
                del pinned[block_hash]
                free[block_hash] = None

    def _evict(self) -> None:
        over = self.used_tokens - self.capacity_tokens
        if over <= 0 or not self._free:
            return
        blocks = min(len(self._free), -(-over // self.block_tokens))
        for _ in range(blocks):
            self._free.popitem(last=False)
        self.evicted_tokens += blocks * self.block_tokens
