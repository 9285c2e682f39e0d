"""Deterministic prompt text for trace blocks: the same hash id always gives the same text.

Each trace block (512 tokens) becomes `BLOCK_BYTES` = 512 x 4 bytes of ASCII English-like words,
since the simulator counts `bytes_per_token` = 4 bytes of UTF-8 text as one token. A block's text
starts with its id (`#123 `), so two different ids never share a leading byte run longer than
the common prefix they really have, and then a slice of a fixed 1 MiB word corpus at an offset
drawn from the id (fast: ~2 µs a block, which matters with ~126K distinct ids in 40 minutes). A request's
prompt is its blocks' texts joined and cut to the exact byte length of its token count, so
requests that share hash ids 0..k share exactly the same leading text.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Sequence

from loadtest.trace import TRACE_BLOCK_TOKENS

SIM_BYTES_PER_TOKEN = 4
"""UTF-8 bytes per token under the simulator's accounting (`SimConfig.bytes_per_token`)."""

BLOCK_BYTES = TRACE_BLOCK_TOKENS * SIM_BYTES_PER_TOKEN
"""Bytes of text per trace block (2,048)."""

DEFAULT_CACHE_BLOCKS = 65_536
"""Block texts kept in memory (LRU): about 140 MB."""

_WORDS_TEXT = (
    "the of and to in is was that for on with as by at from his her they this had not are but "
    "be have one all were we when there can an which their said if do will each about how up out "
    "them then she many some so these would other into has more two like him see time could no "
    "make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know get through back much before go "
    "good new write our used me man too any day same right look think also around another came "
    "come work three word must because does part even place well such here take why things help "
    "put years different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show large "
    "often together asked house world going want school important until form food keep children "
    "feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let "
    "night following picture being study second eyes soon times story boys since white days ever "
    "paper hard near sentence better best across during today others however sure means knew its "
    "try told young miles sun ways thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five using himself usually money cache token "
    "router worker prefix request stream model kernel tensor memory queue latency throughput"
)
_VOCAB: tuple[str, ...] = tuple(dict.fromkeys(_WORDS_TEXT.split()))
"""About 300 distinct common English words (~4.6 letters on average)."""

CORPUS_BYTES = 1 << 20
"""Size of the word corpus that block texts are cut from (1 MiB, built once per seed)."""


@functools.lru_cache(maxsize=4)
def _corpus(seed: int) -> str:
    """`CORPUS_BYTES` of ASCII words drawn from `_VOCAB` with a fixed seed (~0.1 s to build)."""
    rng = random.Random(seed)
    words = rng.choices(_VOCAB, k=CORPUS_BYTES // 4)
    return " ".join(words)[:CORPUS_BYTES]


def generate_block(block_id: int, seed: int = 0, size: int = BLOCK_BYTES) -> str:
    """The ASCII text of one block: exactly `size` bytes, a pure function of (`block_id`, `seed`).

    `#<id> ` followed by a slice of the corpus at an offset drawn from the id (SHAKE-128), ending
    with a newline. About 2 µs a block.
    """
    corpus = _corpus(seed)
    head = f"#{block_id} "
    body = size - len(head) - 1
    if body <= 0:
        return (head * (size // len(head) + 1))[:size]
    digest = hashlib.shake_128(block_id.to_bytes(16, "little", signed=True) + seed.to_bytes(8, "little")).digest(8)
    offset = int.from_bytes(digest, "little") % (len(corpus) - body)
    return head + corpus[offset:offset + body] + "\n"


class BlockTexts:
    """Block texts by trace hash id, generated on first use and kept in a bounded LRU cache."""

    def __init__(self, seed: int = 0, cache_blocks: int = DEFAULT_CACHE_BLOCKS) -> None:
        self.seed = seed
        self._block = functools.lru_cache(maxsize=cache_blocks)(self._generate)

    def _generate(self, block_id: int) -> str:
        return generate_block(block_id, self.seed)

    def block(self, block_id: int) -> str:
        """The `BLOCK_BYTES`-byte text of block `block_id`."""
        return self._block(block_id)

    def prompt(self, hash_ids: Sequence[int], prompt_bytes: int) -> str:
        """The prompt text for a request: its blocks' texts joined, cut to `prompt_bytes` bytes.

        `prompt_bytes` must not exceed `len(hash_ids) * BLOCK_BYTES`; only the blocks it covers
        are generated.
        """
        if prompt_bytes <= 0:
            return ""
        needed = -(-prompt_bytes // BLOCK_BYTES)
        if needed > len(hash_ids):
            raise ValueError(f"{prompt_bytes} bytes need {needed} blocks, the request has {len(hash_ids)}")
        text = "".join([self._block(h) for h in hash_ids[:needed]])
        return text[:prompt_bytes]

    def cache_info(self) -> str:
        """The LRU cache's hit/miss counters, for logs."""
        return str(self._block.cache_info())


def prompt_bytes_for(input_tokens: int, overhead_tokens: int, bytes_per_token: int = SIM_BYTES_PER_TOKEN) -> int:
    """Text bytes that the simulator counts as `input_tokens` prompt tokens for one message:
    (`input_tokens` - `overhead_tokens` per message) x `bytes_per_token`, at least 1 token."""
    return max(1, input_tokens - overhead_tokens) * bytes_per_token
