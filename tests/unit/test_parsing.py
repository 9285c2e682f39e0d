"""gateway/parsing.py without processes: the engine's body a parse process prepares, the cheap lower
bound (it refuses only what the full estimate refuses too), and when a body is kept in chunks."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from gateway.config import parse_config
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.parsing import (
    OUTPUT_LIMIT_FIELD,
    BodyParser,
    ChunkedBody,
    ForwardBody,
    ParsePool,
    body_of,
    encode_for,
    upstream_body,
    with_output_limit,
)
from gateway.routing.params import EstimationConfig, TextRates
from gateway.routing.pools import fitting_pools

PAYLOADS: list[dict[str, Any]] = [
    {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "top_k": 5,
     "seed": 18446744073709551615},
    {"model": "kimi-k3", "messages": [], "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
    {"stream_options": {"x": 1}, "model": "kimi-k3"},
    {"model": "kimi-k3"},
    {"prompt": [1, 2, 3], "model": "kimi-k3", "tools": [{"a": [1, {"b": None}]}]},
    {"request_id": "resp_1", "model": "kimi-k3", "rid": "r", "kv_transfer_params": {"remote_host": "10.6.6.6"},
     "bootstrap_host": "10.6.6.6", "bootstrap_port": None, "bootstrap_room": 7, "input": "hi"},
    {"kv_transfer_params": {"remote_port": 5600}},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_forward_body_equals_the_payload_encoding(payload: dict[str, Any]) -> None:
    keys = [("kimi-k3", False), ("moonshotai/Kimi-K3", True), ("kimi-k3", True), ("other", False),
            ("kimi-k3", False, False, True), ("other", True, True, True)]
    for first in keys:
        forward = ForwardBody.of(payload, *first)
        assert forward.encode(*first) is forward.first
        for key in keys:
            expected = upstream_body(payload, *key)
            assert orjson.loads(forward.encode(*key)) == orjson.loads(expected), (first, key)
            assert orjson.loads(encode_for(forward, *key)) == orjson.loads(encode_for(payload, *key))


@pytest.mark.parametrize("offloaded", [False, True])
def test_engine_ids_never_reach_an_engine_and_kv_fields_only_where_allowed(offloaded: bool) -> None:
    kv = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 5600},
          "bootstrap_host": "10.6.6.6", "bootstrap_port": 8998, "bootstrap_room": 7}
    payload = {"model": "kimi-k3", "input": "hi", "request_id": "resp_someone_elses", "rid": "r", **kv}
    encoded = ForwardBody.of(payload, "kimi-k3", False) if offloaded else payload
    assert orjson.loads(encode_for(encoded, "served", False)) == {"model": "served", "input": "hi"}
    assert orjson.loads(encode_for(encoded, "served", False, False, True)) == {"model": "served", "input": "hi", **kv}


def test_forward_body_refuses_what_cannot_be_written() -> None:
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidRequest):
        ForwardBody.of({"model": "m", "x": deep}, "m", False)


def test_body_of_joins_small_bodies_only() -> None:
    assert body_of([b"ab"], 2, 0) == b"ab"
    assert body_of([b"ab", b"cd"], 4, 4) == b"abcd"
    chunked = body_of([b"ab", b"cd"], 4, 3)
    assert isinstance(chunked, ChunkedBody) and len(chunked) == 4 and chunked.chunks == [b"ab", b"cd"]


CONFIG = parse_config({"pools": [
    {"name": "small", "engine": "vllm", "workers": ["http://127.0.0.1:1"], "max_context_tokens": 4096},
    {"name": "large", "engine": "sglang", "workers": ["http://127.0.0.1:2"], "max_context_tokens": 20_000},
]}, environ={})


def random_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.6:
        messages: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 300)):
            if rng.random() < 0.5:
                messages.append({"role": "user", "content": "é" * rng.choice([0, 10, 300, 3000])})
            else:
                parts: list[dict[str, Any]] = [{"type": "text", "text": "w " * rng.choice([1, 50, 500])}
                                               for _ in range(rng.randint(0, 3))]
                parts += [{"type": "image_url", "image_url": {"url": f"https://x.test/{i}.png"}}
                          for i in range(rng.choice([0, 0, 1, 5, 20]))]
                messages.append({"role": "user", "content": parts})
        body: dict[str, Any] = {"model": "kimi-k3", "messages": messages}
        if rng.random() < 0.5:
            body[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.choice([1, 1000, 15_000])
        return "chat", body
    prompt: Any = rng.choice([
        "t" * rng.choice([10, 50_000, 200_000]),
        [7] * rng.choice([10, 19_000, 25_000]),
        [[7] * rng.choice([1, 5_000, 21_000]) for _ in range(rng.randint(1, 4))],
        ["t" * rng.choice([10, 90_000, 200_000]) for _ in range(rng.randint(1, 3))],
    ])
    body = {"model": "kimi-k3", "prompt": prompt}
    if rng.random() < 0.5:
        body["max_tokens"] = rng.choice([1, 1000, 15_000])
    return "completions", body


def test_the_lower_bound_refuses_only_what_the_estimate_refuses() -> None:
    parser = BodyParser(CONFIG)
    rng = random.Random(15)
    refused_early = 0
    for _ in range(400):
        api, payload = random_body(rng)
        try:
            parser.check_size(api, payload)
        except ContextLengthExceeded:
            refused_early += 1
            wire, model, _ = parser.validate(api, payload)
            with pytest.raises(ContextLengthExceeded):
                fitting_pools(parser.features(wire, model, None, None), CONFIG.pools)
    assert refused_early > 40  # the bound does refuse the plainly oversized ones


def test_the_lower_bound_refuses_before_validation() -> None:
    parser = BodyParser(CONFIG)
    not_even_valid = [{"role": "robot", "content": [{"type": "image_url"}] * 400}]
    with pytest.raises(ContextLengthExceeded) as info:
        parser.check_size("chat", {"model": "kimi-k3", "messages": not_even_valid})
    assert "at least" in info.value.message and "20000 tokens" in info.value.message
    with pytest.raises(ContextLengthExceeded):
        parser.check_size("completions", {"model": "kimi-k3", "prompt": [[1], [2] * 20_001, "x"]})
    # Within the limits: the count is returned, nothing refused.
    assert parser.check_size("completions", {"model": "kimi-k3", "prompt": [[1], [2] * 5, 3]}) == 7


@pytest.mark.anyio
async def test_a_reload_reaches_the_parse_processes() -> None:
    """The parse processes bound requests by the pools they were started with: a reload that adds a
    larger pool (ParsePool.reconfigure, called by gateway/serving/reload.py) must let its requests through."""
    grown = CONFIG.model_copy(update={"pools": [*CONFIG.pools, CONFIG.pools[1].model_copy(
        update={"name": "huge", "max_context_tokens": 400_000})]})
    body = orjson.dumps({"model": "kimi-k3", "prompt": "t" * 1_000_000})  # >= 125,000 tokens at any rate
    pool = ParsePool(CONFIG.model_copy(update={"parse_processes": 1}))
    try:
        with pytest.raises(ContextLengthExceeded):
            await pool.parse("completions", body, None, None)
        pool.reconfigure(grown.model_copy(update={"parse_processes": 1}))
        parsed = await pool.parse("completions", body, None, None)
        assert parsed.request is not None and parsed.request.prompt_tokens > 125_000
    finally:
        pool.close()


def test_the_lower_bound_follows_the_configured_text_rates() -> None:
    """A model whose tokenizer folds whitespace into words (rate 0): 400,000 spaces are no tokens to
    the estimate, so the bound must not count them at 8 characters a token either."""
    config = CONFIG.model_copy(update={"estimation": EstimationConfig(text_rates=TextRates(whitespace=0.0))})
    parser = BodyParser(config)
    payload = {"model": "kimi-k3", "messages": [{"role": "user", "content": " " * 400_000}]}
    parser.check_size("chat", payload)
    wire, model, _ = parser.validate("chat", payload)
    assert fitting_pools(parser.features(wire, model, None, None), config.pools)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_lower_bound_reads_the_output_limit_the_estimate_reads(api: str) -> None:
    """`max_completion_tokens` ranks over `max_tokens` on both APIs, and `5.0` is the integer 5
    (Schemathesis: a completion with `max_completion_tokens: 102.0, max_tokens: 286302` was refused by
    the lower bound, while routing would have reserved 102 tokens)."""
    parser = BodyParser(CONFIG)
    head: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if api == "chat"
                            else {"prompt": "hi"})
    payload = {"model": "kimi-k3", **head, "max_tokens": 10**9, "max_completion_tokens": 102.0}
    parser.check_size(api, payload)  # nothing refused: the 102 tokens fit
    wire, model, _ = parser.validate(api, payload)
    assert fitting_pools(parser.features(wire, model, None, None), CONFIG.pools)
    with pytest.raises(ContextLengthExceeded):
        parser.check_size(api, {"model": "kimi-k3", **head, "max_completion_tokens": 10.0**9})


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_an_output_limit_set_by_the_gateway_reaches_every_pools_body(api: str, payload: dict[str, Any]) -> None:
    """`with_output_limit` (a token-limited key's reservation, issue 25 §3) on a decoded payload and
    on a parse process's ForwardBody gives the same engine body, for every pool's encoding."""
    name = OUTPUT_LIMIT_FIELD[api]
    keys = [("kimi-k3", False, False), ("other", True, False), ("kimi-k3", False, True)]
    for first in keys:
        forward = with_output_limit(ForwardBody.of(payload, *first), api, 321)
        limited = with_output_limit(payload, api, 321)
        for key in keys:
            body = orjson.loads(encode_for(forward, *key))
            assert body == orjson.loads(encode_for(limited, *key)), (first, key)
            renamed = "max_tokens" if key[2] and name == "max_completion_tokens" else name
            assert body[renamed] == 321 and body["model"] == key[0]
    assert with_output_limit(payload, "count_tokens", 321) is payload


def test_the_reservation_counts_what_the_request_forces() -> None:
    """`min_tokens` raises the reserved output when no limit is set, and `best_of` (more candidates
    than `n`) multiplies it; an explicit output limit stays the reservation."""
    parser = BodyParser(parse_config({"pools": [
        {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1"], "max_context_tokens": 131072,
         "default_output_tokens": 100}]}, environ={}))

    def features(api: Any, **fields: Any) -> Any:
        base = {"model": "kimi-k3", **({"prompt": "hi"} if api == "completions" else
                                        {"messages": [{"role": "user", "content": "hi"}]})}
        wire, model, _ = parser.validate(api, {**base, **fields})
        return parser.features(wire, model, None, None)

    plain = features("chat")
    assert plain.reserved_output(100) == 100
    assert features("chat", min_tokens=300).reserved_output(100) == 300
    assert features("chat", min_tokens=300, max_tokens=400).reserved_output(100) == 400
    assert features("chat", min_tokens=50).quota_tokens(100) == plain.quota_tokens(100)
    batch = features("completions", n=2, best_of=5)
    assert batch.outputs == 5 and batch.quota_tokens(100) == batch.prompt_tokens + 500
