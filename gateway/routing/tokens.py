"""Prompt-token estimation for context-length routing (design §4).

Text is counted by script (`script_counts`): ASCII letters, digits, whitespace and punctuation, CJK
ideographs, kana, hangul and CJK punctuation each have their own tokens-per-character rate
(`EstimationConfig.text_rates`), other characters cost UTF-8 bytes / `bytes_per_token`; the sum times
`safety_margin`, rounded up. It errs high, because a request routed to a pool that is too small
costs an engine round trip. One pass of `bytes.translate` and a few `bytes.count` calls over the
UTF-8 bytes: no tokenizer is loaded. Images are
counted from their pixel size when a `data:` URI lets us read it (only the header bytes are
decoded) or when the opt-in image fetch measured an `http(s)://` URL (`image_fetch.py`), else a
configured per-image cost. Audio is counted from the duration its header gives (WAV, FLAC,
MP3; only the first bytes are decoded) times `audio_tokens_per_second`, video at a configured cost.
Each result says its method (`bytes`, `pixels`, `default`, `audio`, `audio_default`, `video`) so the
estimate can be shown on the metric and the debug header.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass

import imagesize

from gateway.errors import InvalidRequest
from gateway.routing.params import EstimationConfig

# Enough base64 to reach the size header of PNG/GIF/WebP and of most JPEGs (SOF after EXIF).
_HEADER_B64_CHARS = 64 * 1024
# Enough for a WAV's chunks before `data` (LIST/INFO tags), FLAC's STREAMINFO, an MP3's ID3v2 tag
# of moderate size and its first frame header.
_AUDIO_HEADER_B64_CHARS = 16 * 1024

CLASS_OF_BYTE = bytes(
    (ord("l") if chr(b).isalpha() else ord("d") if chr(b).isdigit() else ord("s") if chr(b).isspace() else ord("p"))
    if b < 0x80 else
    ord("c") if b < 0xC0 else          # continuation byte
    ord("h") if 0xE4 <= b <= 0xE9 else  # U+4000..U+9FFF: CJK unified ideographs (and ext. A's top)
    ord("g") if 0xEA <= b <= 0xED else  # U+A000..U+DFFF: hangul syllables (and rare Yi, jamo ext.)
    ord("k") if b == 0xE3 else          # U+3000..U+3FFF: CJK punctuation, kana (and rare bopomofo, ext. A)
    ord("f") if b == 0xEF else          # U+F000..U+FFFF: fullwidth punctuation, rare compatibility forms
    ord("o")                            # any other lead byte
    for b in range(256)
)
"""Byte → its class letter in UTF-8 text (a `bytes.translate` table; see `script_counts`)."""
_ASCII_LETTERS = bytes(b for b in range(128) if chr(b).isalpha())  # the class "l" bytes


@dataclass(frozen=True, slots=True)
class ScriptCounts:
    """Characters of UTF-8 text by script: ASCII `latin` letters, `digit`s, `whitespace`,
    `punctuation` (other ASCII: code symbols); `han` (CJK ideographs U+4000..U+9FFF), `kana`
    (U+3040..U+3FFF: kana, and the rarer bopomofo and ext. A ideographs, at a like rate), `hangul`
    syllables, `cjk_punctuation` (U+3000..U+303F and U+F000..U+FFFF: fullwidth forms);
    `other_bytes`: UTF-8 bytes of every other character (accented Latin, Cyrillic, Arabic, emoji...)."""

    latin: int = 0
    digit: int = 0
    whitespace: int = 0
    punctuation: int = 0
    han: int = 0
    kana: int = 0
    hangul: int = 0
    cjk_punctuation: int = 0
    other_bytes: int = 0


def script_counts(data: bytes) -> ScriptCounts:
    """Count the characters of UTF-8 `data` by script (`ScriptCounts`).

    Classifies each byte with one `bytes.translate` and counts the classes with `bytes.count`
    (C loops, about 1 ms per MB each; classes absent from the text are skipped after a memchr);
    CJK punctuation is told from kana by its first two bytes. Lead bytes stand for whole
    characters, so invalid UTF-8 (lone surrogates passed through) is counted, never raises.
    ASCII text drops its letters first (one pass) and classifies only the rest: ~2.5x faster
    on English prose, where letters are ~80 % of the bytes.
    """
    if data.isascii():
        rest = data.translate(None, _ASCII_LETTERS)
        classes = rest.translate(CLASS_OF_BYTE)
        digit = classes.count(b"d") if b"d" in classes else 0
        space = classes.count(b"s")
        return ScriptCounts(len(data) - len(rest), digit, space, len(rest) - digit - space)
    classes = data.translate(CLASS_OF_BYTE)
    digit = classes.count(b"d") if b"d" in classes else 0  # `in` is a memchr: cheap when absent
    space, punct = classes.count(b"s"), classes.count(b"p")
    latin = classes.count(b"l")
    han = classes.count(b"h") if b"h" in classes else 0
    hangul = classes.count(b"g") if b"g" in classes else 0
    kana = cjk_punct = 0
    if b"k" in classes:  # U+3000..U+3FFF: CJK punctuation (U+3000..U+303F) is told by its second byte
        cjk_punct = data.count(b"\xe3\x80")
        kana = classes.count(b"k") - cjk_punct
    if b"f" in classes:
        cjk_punct += classes.count(b"f")
    multibyte = len(data) - latin - digit - space - punct
    other = multibyte - 3 * (han + hangul + kana + cjk_punct)
    return ScriptCounts(latin, digit, space, punct, han, kana, hangul, cjk_punct, max(other, 0))


@dataclass(frozen=True, slots=True)
class ImageEstimate:
    """Tokens for one image, audio clip or video and how they were found (`pixels`, `default`,
    `audio`, `audio_size`, `audio_default`, `video`)."""

    tokens: int
    method: str
    width: int | None = None
    height: int | None = None


class TokenEstimator:
    """Estimates tokens of text and images; pure and cheap (no tokenizer load)."""

    def __init__(self, config: EstimationConfig) -> None:
        self.config = config
        rates = config.text_rates
        margin = config.safety_margin
        self._rates = (rates.latin * margin, rates.digit * margin, rates.whitespace * margin,
                       rates.punctuation * margin, rates.han * margin, rates.kana * margin,
                       rates.hangul * margin, rates.cjk_punctuation * margin, margin / config.bytes_per_token)
        self._tile = math.isqrt(config.image_pixels_per_token) or 1

    def text_tokens(self, text: str) -> int:
        """Estimated tokens of `text` (upper-leaning)."""
        return self.tokens(self.utf8_cost(text.encode("utf-8", "surrogatepass"))) if text else 0

    def utf8_tokens(self, data: bytes) -> int:
        """Estimated tokens of UTF-8 text `data` (upper-leaning)."""
        return self.tokens(self.utf8_cost(data))

    def utf8_cost(self, data: bytes) -> float:
        """Estimated tokens of UTF-8 text `data`, margin included, not yet rounded: costs of several
        pieces add up before one `tokens()` call."""
        if not data:
            return 0.0
        counts = script_counts(data)
        r = self._rates
        return (counts.latin * r[0] + counts.digit * r[1] + counts.whitespace * r[2] + counts.punctuation * r[3]
                + counts.han * r[4] + counts.kana * r[5] + counts.hangul * r[6] + counts.cjk_punctuation * r[7]
                + counts.other_bytes * r[8])

    @staticmethod
    def tokens(cost: float) -> int:
        """A summed `utf8_cost` as whole tokens, rounded up."""
        return math.ceil(cost - 1e-9)  # the epsilon absorbs float error (60*0.3)

    def image_tokens(self, url: str, param: str | None = None,
                     measured: Mapping[str, tuple[int, int]] | None = None) -> ImageEstimate:
        """Estimated tokens of one image given its URL or `data:` URI.

        `measured` maps fetched `http(s)://` URLs to their (width, height) in pixels (the opt-in
        image fetch); a URL not in it costs `image_tokens_default`.
        Raises InvalidRequest for a `data:` URI that is not base64 image data.
        """
        measured = measured or {}
        size = read_data_uri_size(url, param) if url.startswith("data:") else measured.get(url)
        if size is None:
            return ImageEstimate(self.config.image_tokens_default, "default")
        return self.pixel_tokens(*size)

    def audio_tokens(self, source: str, is_base64: bool = False) -> ImageEstimate:
        """Estimated tokens of one audio clip: `source` is an `audio_url` URL or data URI, or with
        `is_base64` an `input_audio` part's base64 `data`.

        Its duration comes from the header (`audio_duration`: method `audio`), else from its size
        at `audio_bytes_per_second` (`audio_size`, erring long); a URL not fetched costs
        `audio_tokens_default` (`audio_default`). Seconds x `audio_tokens_per_second`, rounded up.
        Never raises: the engine judges media it cannot read.
        """
        config = self.config
        payload = source if is_base64 else None
        if payload is None and source[:5].lower() == "data:":
            head = data_uri_head(source, 0)
            payload = source[source.index(",") + 1:] if head is not None else None
        if payload is None:
            return ImageEstimate(config.audio_tokens_default, "audio_default")
        total = base64_payload_bytes(payload)
        try:
            seconds = audio_duration(decode_b64_head(payload[:_AUDIO_HEADER_B64_CHARS]), total)
        except ValueError:
            seconds = None
        method = "audio"
        if seconds is None or not 0 <= seconds < math.inf:
            seconds, method = total / config.audio_bytes_per_second, "audio_size"
        return ImageEstimate(math.ceil(seconds * config.audio_tokens_per_second - 1e-9), method)

    def pixel_tokens(self, width: int, height: int) -> ImageEstimate:
        """Tokens of a `width` x `height` px image: one per `image_pixels_per_token` square tile,
        each side rounded up, clamped to [`image_tokens_min`, `image_tokens_max`]."""
        cap = self.config.image_tokens_max
        side = self._tile * cap  # beyond this many pixels a side alone reaches the cap
        if width >= side or height >= side:
            return ImageEstimate(cap, "pixels", width, height)
        tiles = math.ceil(width / self._tile) * math.ceil(height / self._tile)
        tokens = min(max(tiles, self.config.image_tokens_min), cap)
        return ImageEstimate(tokens, "pixels", width, height)


def read_data_uri_size(url: str, param: str | None = None) -> tuple[int, int] | None:
    """(width, height) in pixels of a base64 `data:` URI holding an image, or None if its format is
    unknown (it then costs the default).

    Accepts what the engines read (vLLM's and SGLang's media loaders): any media type
    (`data:application/octet-stream;base64,...`), base64 wrapped in lines (76-column MIME style) and
    the URL-safe alphabet (`-_`). Only the first `_HEADER_B64_CHARS` characters are decoded.
    Raises InvalidRequest when the URI is not base64 or its start is not valid base64.
    """
    head = data_uri_head(url, _HEADER_B64_CHARS)
    if head is None:
        raise InvalidRequest("image data URIs must look like data:<media type>;base64,<data>",
                             param=param, code="invalid_image_url")
    try:
        raw = decode_b64_head(head)
    except ValueError as exc:
        raise InvalidRequest("image data URI is not valid base64", param=param,
                             code="invalid_image_url") from exc
    return image_size(raw)


_B64_WHITESPACE = str.maketrans("", "", " \t\r\n")
_B64_URLSAFE = str.maketrans("-_", "+/")


def data_uri_head(url: str, chars: int) -> str | None:
    """The first `chars` characters of a `data:[<media type>][;params];base64,<data>` URI's payload
    (wrapping whitespace included), or None when `url` is not a base64 data URI."""
    header, sep, _ = url[:1024].partition(",")
    if not sep or not header.startswith("data:") or not header.lower().endswith(";base64"):
        return None
    start = len(header) + 1
    return url[start:start + chars]


def decode_b64_head(head: str) -> bytes:
    """Bytes of the start of a base64 text: wrapping whitespace dropped, URL-safe `-_` read as `+/`,
    a trailing partial quantum ignored. Raises ValueError when it is not base64."""
    head = head.translate(_B64_WHITESPACE)
    if "-" in head or "_" in head:
        head = head.translate(_B64_URLSAFE)
    head = head[: len(head) - len(head) % 4]
    try:
        return base64.b64decode(head, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(str(exc)) from None


def base64_payload_bytes(text: str) -> int:
    """Decoded size in bytes of a base64 text (whitespace not counted, padding allowed for), without
    decoding it: `str.count` passes only."""
    chars = len(text) - text.count("\n") - text.count("\r") - text.count(" ")
    return max(chars * 3 // 4 - text.count("=", -4), 0)


def audio_duration(head: bytes, total_bytes: int) -> float | None:
    """Seconds of audio in a file of `total_bytes` bytes whose first bytes are `head`, read from its
    header: WAV (RIFF `fmt ` byte rate; the data is the file less its header), FLAC (STREAMINFO
    total samples / sample rate) or MP3 (the first frame's bit rate over the file size). None when
    the header is none of these or is cut short.

    Formats: RIFF/WAVE (Microsoft), FLAC format spec (xiph.org), MPEG-1/2 audio frame header (ISO 11172-3).
    """
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _wav_duration(head, total_bytes)
    if head[:4] == b"fLaC":
        return _flac_duration(head)
    return _mp3_duration(head, total_bytes)


def _wav_duration(head: bytes, total_bytes: int) -> float | None:
    pos, byte_rate = 12, 0
    while pos + 8 <= len(head):
        chunk, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if chunk == b"fmt " and pos + 16 <= len(head):
            byte_rate = int.from_bytes(head[pos + 16:pos + 20], "little")
        elif chunk == b"data":
            return (total_bytes - pos - 8) / byte_rate if byte_rate > 0 else None
        pos += 8 + size + (size & 1)
    return None


def _flac_duration(head: bytes) -> float | None:
    if len(head) < 26 or head[4] & 0x7F != 0:  # the first metadata block must be STREAMINFO
        return None
    info = int.from_bytes(head[18:26], "big")  # 20 bits rate, 3 channels, 5 bits/sample, 36 samples
    rate, samples = info >> 44, info & ((1 << 36) - 1)
    return samples / rate if rate and samples else None


_MP3_KBPS = {  # (MPEG version bit, layer III bits) -> bit rate index -> kbit/s
    1: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    0: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}


def _mp3_duration(head: bytes, total_bytes: int) -> float | None:
    start = 0
    if head[:3] == b"ID3" and len(head) >= 10:  # skip an ID3v2 tag: 4 x 7-bit size
        start = 10 + sum((head[6 + i] & 0x7F) << (7 * (3 - i)) for i in range(4))
    frame = head[start:start + 4]
    if len(frame) < 4 or frame[0] != 0xFF or frame[1] & 0xE0 != 0xE0 or (frame[1] >> 1) & 3 != 1:
        return None  # not an MPEG layer III frame sync
    index = frame[2] >> 4
    if not 0 < index < 15:
        return None
    kbps = _MP3_KBPS[(frame[1] >> 3) & 1][index]
    return (total_bytes - start) * 8 / (kbps * 1000)


def image_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) in pixels read from the first bytes of an image file, None when they do not
    (yet) hold a size header of a format `imagesize` knows (PNG, JPEG, GIF, WebP, TIFF, AVIF, SVG...).

    A prefix too short to hold the header gives None, never a wrong size (imagesize returns -1
    for a truncated header and raises nothing).
    """
    width, height = imagesize.get(io.BytesIO(head))
    # imagesize gives floats for SVG, possibly inf; anything not a finite positive size is unknown.
    if 0 < width < math.inf and 0 < height < math.inf:
        return math.ceil(width), math.ceil(height)
    return None
