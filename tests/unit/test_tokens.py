"""Token estimation: text by script, images by pixels from data URIs, audio by its header's duration."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.errors import InvalidRequest
from gateway.routing.params import EstimationConfig, TextRates
from gateway.routing.tokens import ScriptCounts, TokenEstimator, image_size, read_data_uri_size, script_counts
from loadtest.estimate_calibration import qwen_tokenizer, samples
from tests.media import wav_bytes

IMAGES = [
    ("chelsea_cat_48.png", "png", (48, 32)),
    ("coffee_336.jpg", "jpeg", (336, 224)),
    ("text_448x172.png", "png", (448, 172)),
    ("hubble_deep_field_800.jpg", "jpeg", (800, 698)),
]


def data_uri(path: Path, kind: str) -> str:
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.mark.parametrize(("text", "counts"), [
    ("", ScriptCounts()),
    ("def f(x):\n    return x + 42", ScriptCounts(latin=12, digit=2, whitespace=9, punctuation=4)),
    ("東京は日本の首都です。", ScriptCounts(han=6, kana=4, cjk_punctuation=1)),
    ("서울은 한국의 수도입니다.", ScriptCounts(whitespace=2, punctuation=1, hangul=11)),
    ("中文，标点（全角）！", ScriptCounts(han=6, cjk_punctuation=4)),  # noqa: RUF001
    ("Привет, 😀 é", ScriptCounts(whitespace=2, punctuation=1, other_bytes=6 * 2 + 4 + 2)),
    ("㐀䶵 ㄅ", ScriptCounts(whitespace=1, kana=2, han=1)),  # U+3400..U+3FFF at the kana rate, U+4000.. as han
])
def test_script_counts_classify_each_character(text: str, counts: ScriptCounts) -> None:
    assert script_counts(text.encode()) == counts


def test_lone_surrogates_are_counted_not_raised() -> None:
    assert TokenEstimator(EstimationConfig()).text_tokens("a\ud800b") >= 1


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0),
    ("abcdefg", 2),            # 7 letters * 0.24 * 1.05 = 1.76 -> 2
    ("東京" * 10, 16),         # 20 ideographs * 0.76 * 1.05 = 15.96 -> 16 (bytes/3.5 gave 18)
    ("한국어" * 10, 31),       # 30 syllables * 0.97 * 1.05 = 30.555 -> 31 (bytes/3.5 gave 27: under Qwen's 27)
    ("é" * 10, 8),             # 20 bytes / 2.7 * 1.05 = 7.8 -> 8
])
def test_text_tokens_by_script_rates_with_margin(text: str, tokens: int) -> None:
    assert TokenEstimator(EstimationConfig()).text_tokens(text) == tokens


def test_rates_are_configuration() -> None:
    text = "日本語のテキスト"
    default = TokenEstimator(EstimationConfig()).text_tokens(text)
    doubled = TokenEstimator(EstimationConfig(text_rates=TextRates(han=1.52, kana=1.62))).text_tokens(text)
    assert doubled >= 2 * default - 1


def test_several_pieces_are_rounded_once() -> None:
    estimator = TokenEstimator(EstimationConfig())
    pieces = [b"ab", b"cd", b"ef"]
    assert estimator.tokens(sum(estimator.utf8_cost(p) for p in pieces)) == estimator.utf8_tokens(b"abcdef")


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
    "data:image/png,notbase64",
    "data:image/png;charset=utf-8,notbase64",
    "data:image/png;base64",
    "data:image/png;base64,@@@@",
])
def test_bad_data_uris_are_invalid_requests(uri: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        TokenEstimator(EstimationConfig()).image_tokens(uri, param="messages[0].content[0].image_url.url")
    assert info.value.param == "messages[0].content[0].image_url.url"
    assert info.value.code == "invalid_image_url"


@pytest.mark.parametrize("media_type", ["image/x-made-up", "text/plain", "application/octet-stream"])
def test_unknown_image_format_falls_back_to_default(media_type: str) -> None:
    uri = f"data:{media_type};base64," + base64.b64encode(b"not an image at all").decode()
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


@pytest.fixture(scope="module")
def qwen_tokenize() -> Callable[[str], list[bytes]]:
    """Qwen's 151K-token BPE (the `qwen.tiktoken` file of the dashscope wheel, installed by scripts/bootstrap)."""
    return qwen_tokenizer()


def test_default_rates_err_high_by_a_bounded_margin_for_every_script(
        qwen_tokenize: Callable[[str], list[bytes]]) -> None:
    """Chinese, Japanese, Korean, English, code and mixed text: estimate / true count in [1.0, 1.5]
    (the flat bytes/3.5 rate under-counted Korean: 0.84x)."""
    estimator = TokenEstimator(EstimationConfig())
    ratios: dict[str, list[float]] = {}
    for kind, text in samples([]):
        ratios.setdefault(kind, []).append(estimator.text_tokens(text) / len(qwen_tokenize(text)))
    assert set(ratios) >= {"english", "code", "zh", "ja", "ko", "mixed"}
    for kind, values in ratios.items():
        assert min(values) >= 1.0 and max(values) <= 1.5, (kind, min(values), max(values))


def test_own_mixed_prompt_errs_high(qwen_tokenize: Callable[[str], list[bytes]]) -> None:
    text = ("请把下面的 JSON 翻译成韩语：{\"greeting\": \"こんにちは、世界\", \"count\": 12345}\n"  # noqa: RUF001
            "답변은 한국어로 해 주세요. Thanks!\n") * 20
    estimate = TokenEstimator(EstimationConfig()).text_tokens(text)
    true = len(qwen_tokenize(text))
    assert true <= estimate <= 1.5 * true


def test_input_audio_wav_costs_its_duration_not_its_bytes() -> None:
    """The issue's example: ~11 MB of base64 WAV, over 4 minutes of 16 kHz audio, was 43 tokens."""
    data = base64.b64encode(wav_bytes(250.0)).decode()
    assert len(data) > 10_000_000
    estimate = TokenEstimator(EstimationConfig()).audio_tokens(data, is_base64=True)
    assert (estimate.tokens, estimate.method) == (250 * 25, "audio")


@pytest.mark.parametrize(("seconds", "rate", "channels", "info"), [
    (3.0, 44100, 2, b""), (10.5, 8000, 1, b"INFOISFT" + (13).to_bytes(4, "little") + b"Lavf60.3.100\0\0")])
def test_audio_url_data_uri_wav_with_other_rates_and_chunks(seconds: float, rate: int, channels: int,
                                                            info: bytes) -> None:
    uri = "data:audio/wav;base64," + base64.b64encode(wav_bytes(seconds, rate, channels, info_chunk=info)).decode()
    estimate = TokenEstimator(EstimationConfig(audio_tokens_per_second=10)).audio_tokens(uri)
    assert (estimate.tokens, estimate.method) == (math.ceil(seconds * 10), "audio")


def test_flac_and_mp3_headers_give_their_duration() -> None:
    # FLAC STREAMINFO: 20 bits sample rate 48000, 3 bits channels-1, 5 bits bits-1, 36 bits samples (60 s).
    info = (48000 << 44) | (1 << 41) | (15 << 36) | (48000 * 60)
    streaminfo = (1024).to_bytes(2, "big") * 2 + bytes(6) + info.to_bytes(8, "big") + bytes(16)
    flac = b"fLaC" + bytes([0x80]) + len(streaminfo).to_bytes(3, "big") + streaminfo
    estimator = TokenEstimator(EstimationConfig())
    assert estimator.audio_tokens(base64.b64encode(flac).decode(), is_base64=True).tokens == 60 * 25
    # MPEG-1 layer III, 128 kbit/s (index 9), 44.1 kHz, after a 20-byte ID3v2 tag: 160,000 bytes = 10 s.
    id3 = b"ID3\x04\x00\x00" + bytes([0, 0, 0, 10]) + bytes(10)
    mp3 = id3 + b"\xff\xfb\x90\x64" + bytes(160_000 - 4)
    estimate = estimator.audio_tokens("data:audio/mpeg;base64," + base64.b64encode(mp3).decode())
    assert (estimate.tokens, estimate.method) == (10 * 25, "audio")


@pytest.mark.parametrize("data", ["", "AAAA", "not base64 at all!", base64.b64encode(b"OggS" + bytes(30_000)).decode()])
def test_unreadable_audio_costs_its_size_at_a_low_bitrate(data: str) -> None:
    estimator = TokenEstimator(EstimationConfig(audio_bytes_per_second=1000, audio_tokens_per_second=20))
    estimate = estimator.audio_tokens(data, is_base64=True)
    assert estimate.method == "audio_size"
    assert estimate.tokens == math.ceil(len(data) * 3 // 4 / 1000 * 20)


def test_audio_urls_cost_the_configured_default() -> None:
    estimate = TokenEstimator(EstimationConfig(audio_tokens_default=321)).audio_tokens("https://host/a.wav")
    assert (estimate.tokens, estimate.method) == (321, "audio_default")


def test_image_data_uris_the_engines_read_are_measured(shared_data: Path) -> None:
    """Any media type, MIME line-wrapped base64 and the URL-safe alphabet (all were 400s)."""
    raw = (shared_data / "images" / "hubble_deep_field_800.jpg").read_bytes()
    plain = base64.b64encode(raw).decode()
    wrapped = "\r\n".join(plain[i:i + 76] for i in range(0, len(plain), 76))
    urlsafe = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert "-" in urlsafe[:60_000] or "_" in urlsafe[:60_000]
    for uri in (f"data:application/octet-stream;base64,{plain}", f"data:image/jpeg;base64,{wrapped}",
                f"data:image/jpeg;base64,{urlsafe}", f"data:;base64,{plain}"):
        assert read_data_uri_size(uri) == (800, 698), uri[:40]
    png = (shared_data / "images" / "chelsea_cat_48.png").read_bytes()
    wrapped_png = "\n".join(base64.b64encode(png).decode()[i:i + 64] for i in range(0, 4000, 64))
    assert read_data_uri_size(f"data:application/octet-stream;base64,{wrapped_png}") == (48, 32)
