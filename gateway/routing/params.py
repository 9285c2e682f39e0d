"""The routing package's config sections (pydantic only): the prompt-token estimate and image URL
fetching. Each policy's `policy_params` model lives with its policy (gateway/routing/policies/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, IPvAnyNetwork, model_validator

from gateway.config_base import Section


class TextRates(Section):
    """Tokens per character of each script class (`gateway/routing/tokens.py: script_counts`), before
    `safety_margin`. They depend on the model's tokenizer. The defaults are measured with Qwen's
    151K-token BPE vocabulary (the `qwen.tiktoken` file shipped in the `dashscope` wheel, read by
    `tiktoken`; `python -m loadtest.estimate_calibration`), rounded up: README "Prompt-token estimate"."""

    latin: float = Field(default=0.24, ge=0, description="tokens per ASCII letter")
    digit: float = Field(default=1.0, ge=0, description="tokens per ASCII digit")
    whitespace: float = Field(default=0.29, ge=0, description="tokens per ASCII space, tab or newline")
    punctuation: float = Field(default=0.49, ge=0, description="tokens per other ASCII character (code symbols)")
    han: float = Field(default=0.76, ge=0, description="tokens per CJK ideograph")
    kana: float = Field(default=0.81, ge=0, description="tokens per hiragana or katakana character")
    hangul: float = Field(default=0.97, ge=0, description="tokens per hangul syllable")
    cjk_punctuation: float = Field(default=1.0, ge=0, description="tokens per CJK or fullwidth punctuation mark")


class EstimationConfig(Section):
    """How prompt tokens are estimated before routing (design §4). Errs on the high side."""

    text_rates: TextRates = Field(default_factory=TextRates, description="tokens per character, by script")
    bytes_per_token: float = Field(
        default=2.7, gt=0, description="UTF-8 bytes per token of characters without a `text_rates` class "
        "(accented Latin, Cyrillic, Arabic, emoji...)")
    safety_margin: float = Field(default=1.05, ge=1.0, description="multiplier on the text estimate")
    tokens_per_message: int = Field(default=8, ge=0, description="chat-template overhead per message")
    tokens_per_request: int = Field(
        default=32, ge=0, description="fixed chat overhead: assistant header, a default system prompt"
    )
    pooling_special_tokens: int = Field(
        default=4, ge=0,
        description="special tokens a pooling model's tokenizer adds to each sequence (an embeddings input, a rerank "
        "or score pair): 4 covers the most a cross-encoder adds around a pair (XLM-RoBERTa's); raise it for an LLM "
        "reranker's score template")
    image_tokens_default: int = Field(
        default=1280, ge=0, description="cost of an image whose size cannot be read (e.g. an http URL)"
    )
    image_pixels_per_token: int = Field(
        default=28 * 28, gt=0, description="pixels per vision token: 14 px patches merged 2x2 (MoonViT)"
    )
    image_tokens_min: int = Field(default=64, ge=0, description="fewest tokens an image is estimated at")
    image_tokens_max: int = Field(default=16384, ge=1, description="most tokens an image is estimated at")
    audio_tokens_per_second: float = Field(
        default=25.0, ge=0, description="tokens per second of audio (Whisper-style encoders: 50 frames/s "
        "pooled 2x; Kimi-Audio's tokenizer runs at 12.5 Hz), applied to the duration read from its header")
    audio_bytes_per_second: float = Field(
        default=2000.0, gt=0, description="for audio whose header cannot be read: its size in bytes over this "
        "gives a duration that errs long (2,000 B/s is 16 kbit/s, below voice codecs' usual rates)")
    audio_tokens_default: int = Field(
        default=750, ge=0, description="cost of an audio clip given by URL (30 s at 25 tokens/s)")
    video_tokens_default: int = Field(
        default=8192, ge=0, description="cost of a video part (its frames are not read)")

    @model_validator(mode="after")
    def _image_bounds(self) -> EstimationConfig:
        if self.image_tokens_min > self.image_tokens_max:
            raise ValueError(f"image_tokens_min ({self.image_tokens_min}) must not exceed image_tokens_max "
                             f"({self.image_tokens_max})")
        return self


class ImageFetchConfig(Section):
    """Opt-in fetching of client `http(s)://` image URLs to measure their pixel size (README "Image URLs").

    The fetch only measures: the URL is forwarded unchanged and the engine fetches it itself. A
    fetch that fails, times out or is refused costs `estimation.image_tokens_default`, as with the
    fetch off; it never fails the request. Addresses are checked after DNS resolution, on every
    redirect hop, and the connection goes to the checked address (gateway/routing/address_policy.py).
    """

    enabled: bool = Field(default=False, description="fetch http(s) image URLs to measure them")
    timeout: float = Field(default=2.0, gt=0, description="seconds for one image: DNS, connect, redirects, body")
    request_budget: float = Field(default=3.0, gt=0, description="seconds for all the fetches of one request")
    max_bytes: int = Field(
        default=256 * 1024, ge=1024,
        description="bytes read per image at most; reading stops as soon as the size header has arrived",
    )
    max_redirects: int = Field(default=3, ge=0, le=10, description="redirects followed, each hop checked again")
    max_images: int = Field(default=16, ge=1, description="distinct URLs fetched per request; others cost the default")
    concurrency: int = Field(default=4, ge=1, description="fetches of one request at once")
    max_in_flight: int = Field(default=64, ge=1, description="fetches of this replica at once")
    allowed_schemes: list[Literal["http", "https"]] = Field(
        default_factory=lambda: ["http", "https"], min_length=1, description="URL schemes of images it measures")
    allow_networks: list[IPvAnyNetwork] = Field(
        default_factory=list,
        description="networks fetched from although not public (loopback, private, link-local...), "
        'e.g. ["10.20.0.0/16"] for an internal image host; empty: public addresses only',
    )
    cache_entries: int = Field(default=4096, ge=0, description="measured sizes kept, by URL (0: none)")
    cache_ttl: float = Field(default=600.0, gt=0, description="seconds a measured size is reused")
