"""Measure tokens per character by script with real tokenizers, and check the gateway's estimate.

    .venv/bin/python -m loadtest.estimate_calibration                   # Qwen BPE (dashscope wheel)
    .venv/bin/python -m loadtest.estimate_calibration --engine smollm2  # also the CPU test engine
    .venv/bin/python -m loadtest.estimate_calibration --bench           # time of one 1 MB estimate

Tokenizers: Qwen's 151,643-token byte-level BPE (`qwen.tiktoken`, shipped inside the `dashscope`
wheel, Apache-2.0; read with `tiktoken` and Qwen's own pre-tokenizer pattern), a large multilingual
vocabulary like Kimi's own tiktoken BPE; and, with `--engine smollm2`, the 49,152-token SmolLM2
vocabulary of the llama.cpp test engine (`gateway/llamacpp_worker`) through its `/tokenize` endpoint.
Nothing is downloaded: `pip install tiktoken` and `pip install --no-deps dashscope` (only its data
file is read).

Texts: English from the three public-domain books in `../shared/data/text/books`, code (this
repo's own Python), Chinese, Japanese and Korean prose written for this repo
(`tests/data/estimate/`, licence note there), and mixed text built from them; `--extra FILE`
adds more (each file one sample).

Each token's count is split evenly over its bytes and summed per script class of those bytes
(`gateway/routing/tokens.py: script_counts`), which gives tokens per character of each class on
real text; then every sample's estimate with the given rates is compared with its true count.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import CLASS_OF_BYTE, TokenEstimator

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "estimate"
BOOKS = Path(os.environ.get("KIMI_SHARED_DATA", ROOT.parent / "shared" / "data")) / "text" / "books"

# Qwen's pre-tokenizer (dashscope/tokenizers/qwen_tokenizer.py, PAT_STR).
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CLASSES = ("latin", "digit", "whitespace", "punctuation", "han", "kana", "hangul", "cjk_punctuation", "other")
Tokenize = Callable[[str], list[bytes]]


def qwen_tokenizer() -> Tokenize:
    """Token pieces (bytes) of a text by Qwen's BPE; needs `tiktoken` and the `dashscope` wheel."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps dashscope (for its qwen.tiktoken file) and pip install tiktoken")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    ranks = load_tiktoken_bpe(str(path))
    encoding = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return lambda text: encoding.decode_tokens_bytes(encoding.encode_ordinary(text))


def engine_tokenizer(url: str) -> Tokenize:
    """Token pieces of a text by a llama.cpp server's `/tokenize` (`with_pieces`)."""
    client = httpx.Client(base_url=url, timeout=60)

    def tokenize(text: str) -> list[bytes]:
        pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        return [bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces]
    return tokenize


def byte_classes(data: bytes) -> list[str]:
    """The script class of each byte of UTF-8 `data` (a continuation byte takes its lead's)."""
    names = {"l": "latin", "d": "digit", "s": "whitespace", "p": "punctuation", "h": "han", "g": "hangul",
             "f": "cjk_punctuation", "o": "other"}
    out: list[str] = []
    i = 0
    while i < len(data):
        lead = chr(CLASS_OF_BYTE[data[i]])
        width = 1 if data[i] < 0x80 else 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
        head = data[i:i + 2]
        cls = names.get(lead, "other") if lead != "k" else "cjk_punctuation" if head == b"\xe3\x80" else "kana"
        out.extend([cls] * width)
        i += width
    return out[:len(data)]


def attribute(text: str, pieces: list[bytes]) -> tuple[dict[str, float], dict[str, int]]:
    """(tokens, characters) per script class of `text`; each token is split evenly over its bytes."""
    data = text.encode()
    classes = byte_classes(data)
    tokens = dict.fromkeys(CLASSES, 0.0)
    chars = dict.fromkeys(CLASSES, 0)
    i = 0
    while i < len(data):
        width = 1 if data[i] < 0x80 else 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
        chars[classes[i]] += 1 if classes[i] != "other" else width
        i += width
    pos = 0
    for piece in pieces:
        for k in range(pos, pos + len(piece)):
            tokens[classes[min(k, len(classes) - 1)]] += 1 / len(piece)
        pos += len(piece)
    return tokens, chars


def samples(extra: list[Path]) -> list[tuple[str, str]]:
    """(kind, text) pairs: English, code, zh, ja, ko, mixed."""
    out: list[tuple[str, str]] = []
    for book in sorted(BOOKS.glob("*.txt")):
        text = book.read_text("utf-8")
        out += [("english", text[start:start + 6000]) for start in range(30_000, 330_000, 60_000)]
    for src in sorted((ROOT / "gateway").rglob("*.py"))[:40]:
        code = src.read_text("utf-8")
        if len(code) > 2000:
            out.append(("code", code[:8000]))
    cjk = {}
    for lang in ("zh", "ja", "ko"):
        text = (DATA / f"{lang}.txt").read_text("utf-8")
        cjk[lang] = text
        out.append((lang, text))
        out += [(lang, para) for para in text.split("\n\n") if len(para) > 100]
    english = out[0][1][:1500]
    out.append(("mixed", f"{cjk['zh'][:600]}\n\nTranslate the text above into English:\n{english}"))
    out.append(("mixed", f"以下のコードを説明してください。\n```python\n{out[-2][1][:1500]}\n```\n{cjk['ja'][:300]}"))
    out.append(("mixed", f"{cjk['ko'][:400]} (Python 3.11, 2024-05-01) {english[:500]}"))
    out += [("extra", path.read_text("utf-8")) for path in extra]
    return out


def fit(rows: list[tuple[str, dict[str, int], int]], start: dict[str, float], floor: float) -> dict[str, float]:
    """Rates (tokens per character of each class) whose estimate is at least `floor` x the true count
    of every sample and as close to it as it can be: projected gradient descent on the squared
    relative error, with a steep penalty below `floor`; each kind of text weighs the same."""
    weight = {kind: 1 / sum(1 for k, _, _ in rows if k == kind) for kind, _, _ in rows}
    rates = dict(start)
    step = 0.02
    for _ in range(4000):
        grad = dict.fromkeys(CLASSES, 0.0)
        for kind, chars, true in rows:
            ratio = sum(rates[c] * chars[c] for c in CLASSES) / true
            slope = 2 * (ratio - floor) * (1 if ratio >= floor else 200)
            for c in CLASSES:
                grad[c] += weight[kind] * slope * chars[c] / true
        for c in CLASSES:
            rates[c] = max(0.0, rates[c] - step * grad[c] / max(1, sum(ch[c] for _, ch, _ in rows) / len(rows)))
    return rates


def measure(name: str, tokenize: Tokenize, texts: list[tuple[str, str]], config: EstimationConfig) -> None:
    """Print tokens per character by class, a fit of rates that err high on every sample, and the
    estimate / true count per kind of text with `config`'s rates."""
    total_tokens = dict.fromkeys(CLASSES, 0.0)
    total_chars = dict.fromkeys(CLASSES, 0)
    by_kind: dict[str, list[float]] = {}
    rows: list[tuple[str, dict[str, int], int]] = []
    estimator = TokenEstimator(config)
    for kind, text in texts:
        pieces = tokenize(text)
        tokens, chars = attribute(text, pieces)
        rows.append((kind, chars, len(pieces)))
        for cls in CLASSES:
            total_tokens[cls] += tokens[cls]
            total_chars[cls] += chars[cls]
        by_kind.setdefault(kind, []).append(estimator.text_tokens(text) / len(pieces))
    measured = {c: total_tokens[c] / total_chars[c] if total_chars[c] else 0.0 for c in CLASSES}
    fitted = fit(rows, measured, 1.0)
    print(f"\n{name}: tokens per character by class (other: per UTF-8 byte)")
    print(f"  {'class':16} {'measured':>8} {'fit >= 1':>8}")
    for cls in CLASSES:
        print(f"  {cls:16} {measured[cls]:8.3f} {fitted[cls]:8.3f}   ({total_chars[cls]:,} characters)")
    print(f"{name}: estimate / true tokens (min, mean, max) with the config's rates x {config.safety_margin}")
    for kind, ratios in by_kind.items():
        print(f"  {kind:8} {min(ratios):5.2f} {sum(ratios) / len(ratios):5.2f} {max(ratios):5.2f}"
              f"   ({len(ratios)} samples)")


def bench(size: int = 1 << 20, rounds: int = 20) -> None:
    """Print the time of one estimate of a `size`-byte prompt (best and median of `rounds`), per kind of
    text, next to the flat bytes count it replaced (`len(text.encode())`)."""
    estimator = TokenEstimator(EstimationConfig())
    kinds = {kind: text for kind, text in samples([])}
    print(f"\nestimate of a {size / (1 << 20):.0f} MB prompt, best / median of {rounds} (ms)")
    for kind, text in kinds.items():
        prompt = (text * (size // len(text.encode()) + 1)).encode()[:size].decode("utf-8", "ignore")
        times, flat = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            estimator.text_tokens(prompt)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            len(prompt.encode("utf-8", "surrogatepass"))
            flat.append(time.perf_counter() - start)
        times.sort()
        flat.sort()
        print(f"  {kind:8} {times[0] * 1e3:6.2f} {times[rounds // 2] * 1e3:6.2f}"
              f"   (bytes only: {flat[0] * 1e3:.2f} {flat[rounds // 2] * 1e3:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["smollm2"], help="also measure the llama.cpp CPU test engine")
    parser.add_argument("--extra", type=Path, nargs="*", default=[], help="more UTF-8 text files, one sample each")
    parser.add_argument("--bench", action="store_true", help="only time the estimate of a 1 MB prompt")
    args = parser.parse_args()
    if args.bench:
        bench()
        return
    texts = samples(args.extra)
    measure("Qwen BPE (151,643 tokens)", qwen_tokenizer(), texts, EstimationConfig())
    if args.engine:
        from gateway.llamacpp_worker import LlamaCppSettings, LlamaCppWorker

        with LlamaCppWorker(LlamaCppSettings(n_ctx=16384, threads=1)) as worker:
            from tests.e2e.smollm2 import SMOLLM2_ESTIMATION

            measure("SmolLM2 (llama.cpp /tokenize)", engine_tokenizer(worker.url), texts,
                    EstimationConfig.model_validate(SMOLLM2_ESTIMATION))


if __name__ == "__main__":
    main()
