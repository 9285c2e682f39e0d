"""Token estimation: text by UTF-8 bytes, images by pixels from data URIs."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gateway.config import EstimationConfig
from gateway.errors import InvalidRequest
from gateway.routing.tokens import TokenEstimator, image_size, read_data_uri_size

IMAGES = [
    ("chelsea_cat_48.png", "png", (48, 32)),
    ("coffee_336.jpg", "jpeg", (336, 224)),
    ("text_448x172.png", "png", (448, 172)),
    ("hubble_deep_field_800.jpg", "jpeg", (800, 698)),
]


def data_uri(path: Path, kind: str) -> str:
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0),
    ("abcdefg", 3),            # 7 bytes * 1.05 / 3.5 = 2.1 -> 3
    ("é" * 10, 6),             # 20 bytes * 1.05 / 3.5 = 6.0
    ("東京" * 10, 18),         # 60 bytes * 1.05 / 3.5 = 18.0
])
def test_text_tokens_count_utf8_bytes_with_margin(text: str, tokens: int) -> None:
    estimator = TokenEstimator(EstimationConfig())
    n_bytes = len(text.encode())
    assert estimator.text_tokens(text) == tokens
    assert estimator.text_tokens(text) >= n_bytes / 3.5


def test_text_estimate_never_undercounts_english_books(shared_data: Path) -> None:
    # Real tokenizers give ~4 characters per English token; the estimate must stay above that.
    text = (shared_data / "text" / "books" / "crime_and_punishment_dostoevsky_garnett.txt").read_text()[:200_000]
    estimator = TokenEstimator(EstimationConfig())
    assert estimator.text_tokens(text) > len(text) / 4


@pytest.mark.parametrize(("name", "kind", "size"), IMAGES)
def test_data_uri_pixel_size_is_read_from_the_header(shared_data: Path, name: str, kind: str,
                                                     size: tuple[int, int]) -> None:
    assert read_data_uri_size(data_uri(shared_data / "images" / name, kind)) == size


def test_image_tokens_from_pixels_are_28px_tiles_clamped(shared_data: Path) -> None:
    estimator = TokenEstimator(EstimationConfig())
    hubble = estimator.image_tokens(data_uri(shared_data / "images" / "hubble_deep_field_800.jpg", "jpeg"))
    assert (hubble.tokens, hubble.method) == (29 * 25, "pixels")
    tiny = estimator.image_tokens(data_uri(shared_data / "images" / "chelsea_cat_48.png", "png"))
    assert tiny.tokens == EstimationConfig().image_tokens_min


def test_http_image_urls_cost_the_configured_default() -> None:
    estimator = TokenEstimator(EstimationConfig(image_tokens_default=777))
    estimate = estimator.image_tokens("https://example.com/cat.png")
    assert (estimate.tokens, estimate.method) == (777, "default")


@pytest.mark.parametrize("uri", [
    "data:text/plain;base64,aGVsbG8=",
    "data:image/png,notbase64",
    "data:image/png;base64,@@@@",
])
def test_bad_data_uris_are_invalid_requests(uri: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        TokenEstimator(EstimationConfig()).image_tokens(uri, param="messages[0].content[0].image_url.url")
    assert info.value.param == "messages[0].content[0].image_url.url"
    assert info.value.code == "invalid_image_url"


def test_unknown_image_format_falls_back_to_default() -> None:
    uri = "data:image/x-made-up;base64," + base64.b64encode(b"not an image at all").decode()
    estimate = TokenEstimator(EstimationConfig()).image_tokens(uri)
    assert estimate.method == "default"


@pytest.mark.parametrize(("width", "height"), [("9" * 400, "10"), ("1e308", "1e308"), ("12.5", "7.2")])
def test_svg_sizes_are_clamped_not_crashing(width: str, height: str) -> None:
    svg = f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'></svg>".encode()
    uri = "data:image/svg+xml;base64," + base64.b64encode(svg).decode()
    estimate = TokenEstimator(EstimationConfig()).image_tokens(uri)
    assert EstimationConfig().image_tokens_min <= estimate.tokens <= EstimationConfig().image_tokens_max


def test_measured_http_urls_cost_their_pixels_and_others_the_default() -> None:
    # `measured` is what the opt-in image fetch found (gateway/routing/image_fetch.py).
    estimator = TokenEstimator(EstimationConfig(image_tokens_default=777))
    measured = {"https://img.example/a.jpg": (800, 698)}
    fetched = estimator.image_tokens("https://img.example/a.jpg", measured=measured)
    assert (fetched.tokens, fetched.method, fetched.width, fetched.height) == (29 * 25, "pixels", 800, 698)
    other = estimator.image_tokens("https://img.example/b.jpg", measured=measured)
    assert (other.tokens, other.method) == (777, "default")


@pytest.mark.parametrize(("name", "kind", "size"), IMAGES)
def test_image_size_reads_a_file_head_and_none_before_the_header(shared_data: Path, name: str, kind: str,
                                                                 size: tuple[int, int]) -> None:
    raw = (shared_data / "images" / name).read_bytes()
    assert image_size(raw) == size
    assert image_size(raw[:16]) is None  # too short for any format's size header: unknown, never wrong
