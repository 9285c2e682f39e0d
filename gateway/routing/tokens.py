"""Prompt-token estimation for context-length routing (design §4).

Text is counted as UTF-8 bytes / `bytes_per_token` * `safety_margin`, rounded up: it errs high,
because a request routed to a pool that is too small costs an engine round trip. Images are
counted from their pixel size when a `data:` URI lets us read it (only the header bytes are
decoded) or when the opt-in image fetch measured an `http(s)://` URL (`image_fetch.py`), else a
configured per-image cost. Each result says its method (`bytes`, `pixels`,
`default`) so the estimate can be shown on the metric and the debug header.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass

import imagesize

from gateway.config import EstimationConfig
from gateway.errors import InvalidRequest

# Enough base64 to reach the size header of PNG/GIF/WebP and of most JPEGs (SOF after EXIF).
_HEADER_B64_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class ImageEstimate:
    """Tokens for one image and how they were found (`pixels` or `default`)."""

    tokens: int
    method: str
    width: int | None = None
    height: int | None = None


class TokenEstimator:
    """Estimates tokens of text and images; pure and cheap (no tokenizer load)."""

    def __init__(self, config: EstimationConfig) -> None:
        self.config = config
        self._per_byte = config.safety_margin / config.bytes_per_token
        self._tile = math.isqrt(config.image_pixels_per_token) or 1

    def text_tokens(self, text: str) -> int:
        """Estimated tokens of `text` (upper-leaning)."""
        if not text:
            return 0
        return self.bytes_tokens(len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")))

    def bytes_tokens(self, n_bytes: int) -> int:
        """Estimated tokens of `n_bytes` bytes of UTF-8 text."""
        return math.ceil(n_bytes * self._per_byte - 1e-9)  # the epsilon absorbs float error (60*0.3)

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
    """(width, height) in pixels of a `data:image/...;base64,` URI, or None if the format is unknown.

    Raises InvalidRequest when the URI is not an image or not valid base64.
    """
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise InvalidRequest("image data URIs must look like data:image/<type>;base64,<data>",
                             param=param, code="invalid_image_url")
    head = payload[:_HEADER_B64_CHARS]
    head = head[: len(head) - len(head) % 4]
    try:
        raw = base64.b64decode(head, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest("image data URI is not valid base64", param=param,
                             code="invalid_image_url") from exc
    return image_size(raw)


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
