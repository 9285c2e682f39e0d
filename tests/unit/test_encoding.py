"""Decoding the content codings an engine applied unasked (gateway/backends/encoding.py)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator

import pytest

from gateway.backends.encoding import PIECE_BYTES, DecodeError, UnsupportedEncoding, codings_of, decoded

DATA = b"data: {\"choices\":[{\"delta\":{\"content\":\"hello\"}}]}\n\n" * 2000


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def decode(parts: list[bytes], codings: tuple[str, ...], limit: int = 1 << 30) -> list[bytes]:
    async def run() -> list[bytes]:
        return [piece async for piece in decoded(_chunks(parts), codings, limit)]
    return asyncio.run(run())


def raw_deflate(data: bytes) -> bytes:
    encoder = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return encoder.compress(data) + encoder.flush()


@pytest.mark.parametrize(("value", "codings"), [
    (None, ()), ("", ()), ("identity", ()), ("GZIP", ("gzip",)), (" x-gzip ", ("gzip",)),
    ("deflate, gzip", ("deflate", "gzip")), ("gzip, identity", ("gzip",)),
])
def test_the_codings_of_a_header(value: str | None, codings: tuple[str, ...]) -> None:
    assert codings_of(value) == codings


@pytest.mark.parametrize("value", ["br", "zstd", "compress", "gzip, br", "gzip\u2603", "gzip, gzip, gzip, gzip"])
def test_a_coding_it_cannot_decode_is_refused(value: str) -> None:
    with pytest.raises(UnsupportedEncoding):
        codings_of(value)


@pytest.mark.parametrize(("encoded", "codings"), [
    (gzip.compress(DATA), ("gzip",)),
    (gzip.compress(DATA[:5000]) + gzip.compress(DATA[5000:]), ("gzip",)),  # two gzip members
    (zlib.compress(DATA), ("deflate",)),
    (raw_deflate(DATA), ("deflate",)),  # the raw deflate some servers send as "deflate"
    (gzip.compress(zlib.compress(DATA)), ("deflate", "gzip")),  # deflate first, then gzip
])
@pytest.mark.parametrize("split", [1, 7, 100_000])
def test_an_encoded_body_decodes_in_any_split(encoded: bytes, codings: tuple[str, ...], split: int) -> None:
    parts = [encoded[i:i + split] for i in range(0, len(encoded), split)] if split < 1000 else [encoded]
    assert b"".join(decode(parts, codings)) == DATA


def test_each_piece_is_bounded_and_the_total_is_capped() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))
    assert max(len(piece) for piece in decode([bomb], ("gzip",))) <= PIECE_BYTES
    with pytest.raises(DecodeError, match="decodes to more than 1048576 bytes"):
        decode([bomb], ("gzip",), 1 << 20)


@pytest.mark.parametrize(("parts", "match"), [
    ([gzip.compress(DATA)[:-8]], "ended before its gzip data did"),
    ([b"plain text, not gzip"], "not valid gzip data"),
    ([b"x"], "ended before its deflate data did"),
])
def test_a_broken_or_cut_body_is_a_decode_error(parts: list[bytes], match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(parts, ("deflate",) if parts == [b"x"] else ("gzip",))
