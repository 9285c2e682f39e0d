"""Prefix hashing for cache affinity (design §5), pure functions.

A prompt becomes canonical bytes (per message: role, then text; an image as a digest of its URL
or data URI, never the base64 itself), cut into blocks of `block_bytes`. Block i's hash covers
every byte up to its end: h_i = xxh3_64(canonical[0:(i+1) * block_bytes], seed=xxh3_64(model)),
where a request's cache partition, when it has one (`partition_seed_bytes`), joins the model in the
seed, so differently salted prompts share no block hash, as they share no cache entry in the engine,
taken from one streaming xxh3 state fed up to each sampled block's end (XXH3's streaming digest
equals the one-shot digest of what it was fed), so hashing costs one pass over the bytes plus
one digest per sampled block, not a Python step per block. Equal h_i means an equal prompt up to
the end of block i, so the longest shared prefix is the deepest equal hash.

Only sampled positions are stored and looked up: every block up to `dense_blocks`, then
`blocks_per_octave` per doubling of the position, plus the last block. With the defaults (512-byte
blocks, 32 dense, 8 per octave) a 1M-token prompt (~4 MB, ~8,000 blocks) needs 32 + 8 * 8 + 1 = 97
keys and a 12K-token one ~45; a match is exact to within 12.5 % of its length.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
import xxhash

from gateway.affinity.params import AffinityConfig

ROLE_SEP = b"\x1e"
MESSAGE_SEP = b"\x1f"
IMAGE_TAG = b"\x1dimage:"


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """Sampled chained hashes of one prompt.

    `positions[i]` is a block index (ascending, the last block included); `hashes[i]` its chained
    hash (unsigned 64-bit). `total_bytes` is the canonical prompt's length.
    """

    positions: tuple[int, ...]
    hashes: tuple[int, ...]
    total_bytes: int
    block_bytes: int

    def covered_fraction(self, index: int) -> float:
        """Share of the prompt (0..1] covered by the prefix up to sampled position `index`."""
        end = min((self.positions[index] + 1) * self.block_bytes, self.total_bytes)
        return end / self.total_bytes if self.total_bytes else 0.0


def sampled_positions(n_blocks: int, dense: int, per_octave: int) -> list[int]:
    """Block indices to hash-store for a prompt of `n_blocks` blocks (the same for every prompt,
    so a longer prompt's samples include a shorter one's except for its last block)."""
    positions: list[int] = []
    p = 0
    while p < n_blocks:
        positions.append(p)
        if p + 1 < dense:
            p += 1
        else:
            octave = (p + 1) // dense  # 1 for [dense, 2*dense), 2..3 next, ...
            step = max(1, (dense << (octave.bit_length() - 1)) // per_octave)
            p = (p // step + 1) * step
    if n_blocks and positions[-1] != n_blocks - 1:
        positions.append(n_blocks - 1)
    return positions


def partition_seed_bytes(model: str, partition: str | None) -> bytes:
    """What seeds a prompt's block hashes: the model name, then, for a request whose prefix-cache
    entries the engine keeps apart (`gateway.routing.features.cache_partition`), a separator and that
    partition. The model name alone when `partition` is None, so unsalted hashes stay as they were."""
    base = model.encode("utf-8", "surrogatepass")
    if partition is None:
        return base
    return base + b"\x00partition:" + partition.encode("utf-8", "surrogatepass")


class PrefixHasher:
    """Canonical bytes and sampled chained hashes, parameterised by an AffinityConfig."""

    def __init__(self, config: AffinityConfig) -> None:
        self.block_bytes = config.block_bytes
        self.dense = config.dense_blocks
        self.per_octave = config.blocks_per_octave

    def hash(self, canonical: bytes, model: str, partition: str | None = None) -> PrefixKey:
        """Sampled chained block hashes of `canonical` seeded with `model` and the request's cache
        `partition` (`partition_seed_bytes`; None: none)."""
        size = self.block_bytes
        wanted = _positions(-(-len(canonical) // size), self.dense, self.per_octave)
        view = memoryview(canonical)
        state = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(partition_seed_bytes(model, partition)))
        hashes, fed = [], 0
        for p in wanted:  # ascending block positions
            end = (p + 1) * size
            state.update(view[fed:end])
            fed = end
            hashes.append(state.intdigest())
        return PrefixKey(wanted, tuple(hashes), len(canonical), size)


@functools.lru_cache(maxsize=4096)
def _positions(n_blocks: int, dense: int, per_octave: int) -> tuple[int, ...]:
    """`sampled_positions` as a tuple, computed once per prompt length in blocks (not a Python loop
    per request)."""
    return tuple(sampled_positions(n_blocks, dense, per_octave))


def image_digest(url: str) -> bytes:
    """A short stand-in for an image in canonical bytes: digest of its URL or data URI text."""
    return IMAGE_TAG + xxhash.xxh3_128_hexdigest(url.encode()).encode()


def canonical_message(role: str, parts: Iterable[bytes]) -> bytes:
    """One message as canonical bytes: role, separator, content pieces, end mark."""
    return b"".join((role.encode(), ROLE_SEP, *parts, MESSAGE_SEP))  # one copy of the content


def canonical_prelude(tools: object | None) -> bytes:
    """Request-level content that chat templates render before the messages (tool schemas).

    Raises TypeError for JSON nested deeper than orjson writes (254 levels).
    """
    if tools is None:
        return b""
    return orjson.dumps(tools, option=orjson.OPT_SORT_KEYS) + MESSAGE_SEP


def session_hash(session_key: str) -> int:
    """The affinity store's key (unsigned 64-bit, beside the block hashes) for the worker that served
    a session last: xxh3_64 of a tag and the scoped session key (`gateway.routing.features.scoped_session`).
    A block hash is seeded by the model name, so the two never meet but by a 64-bit collision."""
    return xxhash.xxh3_64_intdigest(b"\x1csession:" + session_key.encode())


def longest_match(key: PrefixKey, owners: Sequence[str | None]) -> dict[str, float]:
    """Per worker, the deepest sampled prefix it owns, as a fraction of the prompt (0..1].

    `owners[i]` is who the store says holds `key.hashes[i]` (None when nobody does).
    """
    matched: dict[str, float] = {}
    for index, owner in enumerate(owners):
        if owner is not None:
            matched[owner] = key.covered_fraction(index)
    return matched
