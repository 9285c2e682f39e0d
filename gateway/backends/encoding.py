"""Decoding an engine answer's content coding the gateway did not ask for.

The gateway asks every engine for `accept-encoding: identity` (backends/h1.py) and relays,
reads and taps identity bytes only. An engine, or a proxy in front of it, that compresses anyway
has its body decoded here, so the client always gets identity bytes (which every client accepts,
RFC 9110 §12.5.3) and the gateway reads usage and SSE events as usual:

- `gzip` (`x-gzip`) and `deflate` (the zlib format of RFC 9110 §8.4.1.2, or the raw deflate some
  servers send instead) are decoded with the standard library's zlib, incrementally (a gzipped
  SSE stream is relayed event by event as the engine flushes), a list of codings
  (`Content-Encoding: deflate, gzip`) last-applied first, `identity` skipped;
- anything else (`br`, `zstd`: no decoder library is installed with the gateway; `compress`,
  unknown names) is `UnsupportedEncoding`: refused before any body byte is read.

Bounds: every decompression step yields at most `PIECE_BYTES`, and a body that decodes to more
than its limit (`max_decoded_bytes`; a few KiB of gzip can decode to gigabytes) raises
`DecodeError` at the byte that crosses it; so does a body that is not valid data of its coding or
ends before its coding's end. `DecodeError` is an `H1Error`: to the relay it is an engine that
broke its answer, handled like any other (retried elsewhere before the first content, an SSE
error event after it, a 502 for a non-streaming answer).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import AsyncIterator, Iterator

from gateway.backends.h1 import H1Error

PIECE_BYTES = 64 * 1024  # the most decoded bytes one decompression step produces
MAX_CODINGS = 3  # a longer list of codings is refused (nobody stacks more)
DECODABLE = frozenset({"gzip", "x-gzip", "deflate"})
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,40}")  # RFC 9110 §5.6.2


class UnsupportedEncoding(ValueError):
    """An engine's `Content-Encoding` the gateway cannot decode; the message names it."""


class DecodeError(H1Error):
    """An encoded body that is not valid data of its coding, ends early, or decodes past its limit."""


def codings_of(value: str | None) -> tuple[str, ...]:
    """The content codings of a `Content-Encoding` header value to undo, in the order they were
    applied (lower-case, `identity` left out); () for none. Raises UnsupportedEncoding for a
    coding this module does not decode, a value that is not a list of tokens, or more than
    MAX_CODINGS codings."""
    if not value:
        return ()
    codings = []
    for item in value.split(","):
        coding = item.strip()
        if not _TOKEN.fullmatch(coding):
            raise UnsupportedEncoding(f"engine answered with content encoding {value[:60]!r}, not a list of tokens")
        coding = coding.lower()
        if coding == "identity":
            continue
        if coding not in DECODABLE:
            raise UnsupportedEncoding(
                f"engine answered with Content-Encoding: {coding} although the gateway asked for identity; "
                f"it decodes only gzip and deflate")
        codings.append("gzip" if coding == "x-gzip" else coding)
    if len(codings) > MAX_CODINGS:
        raise UnsupportedEncoding(f"engine answered with {len(codings)} stacked content codings ({value[:60]!r})")
    return tuple(codings)


class _Layer:
    """One coding's decompressor: feed it encoded bytes, it yields decoded pieces (each at most
    PIECE_BYTES). gzip takes several members one after another (RFC 1952 §2.2); deflate decides on
    its first two bytes between the zlib format and raw deflate."""

    __slots__ = ("_coding", "_head", "_obj", "ended")

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._obj: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding == "gzip" else None
        self._head = b""  # deflate: the bytes before its format is known
        self.ended = False  # the coding's end was reached (more data: a next gzip member)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Decode `data`; raises DecodeError for bytes that are not valid data of the coding."""
        obj = self._obj
        if obj is None:
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return
            self._head = b""
            zlib_format = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0  # RFC 1950 §2.2
            obj = self._obj = zlib.decompressobj(zlib.MAX_WBITS if zlib_format else -zlib.MAX_WBITS)
        try:
            while data:
                if obj.eof:
                    if self._coding != "gzip":
                        return  # bytes after a deflate stream's end: ignored, as browsers do
                    obj = self._obj = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self.ended = False
                piece = obj.decompress(data, PIECE_BYTES)
                data = obj.unconsumed_tail or obj.unused_data
                self.ended = obj.eof
                if piece:
                    yield piece
                while obj.unconsumed_tail == b"" and not obj.eof and len(piece) == PIECE_BYTES:
                    piece = obj.decompress(b"", PIECE_BYTES)  # output still held inside the decompressor
                    if piece:
                        yield piece
                    self.ended = obj.eof
        except zlib.error as exc:
            raise DecodeError(f"the engine's {self._coding}-encoded answer is not valid {self._coding} data "
                              f"({exc})") from None

    def check_end(self) -> None:
        """At the body's end: raises DecodeError unless the coding's data ended there too."""
        if not self.ended:
            raise DecodeError(f"the engine's {self._coding}-encoded answer ended before its {self._coding} data did")


async def decoded(chunks: AsyncIterator[bytes], codings: tuple[str, ...], limit: int) -> AsyncIterator[bytes]:
    """The identity bytes of an encoded body (`chunks`, encoded with `codings` in that order), as
    non-empty chunks of at most PIECE_BYTES. Raises DecodeError (see the module docstring) once
    more than `limit` bytes came out, and the TransportErrors `chunks` raises."""
    layers = [_Layer(coding) for coding in reversed(codings)]
    total = 0

    def through(index: int, data: bytes) -> Iterator[bytes]:
        if index == len(layers):
            yield data
            return
        for piece in layers[index].feed(data):
            yield from through(index + 1, piece)

    async for chunk in chunks:
        for piece in through(0, chunk):
            total += len(piece)
            if total > limit:
                raise DecodeError(f"the engine's {', '.join(codings)}-encoded answer decodes to more than "
                                  f"{limit} bytes (max_decoded_bytes)")
            yield piece
    for layer in layers:
        layer.check_end()
