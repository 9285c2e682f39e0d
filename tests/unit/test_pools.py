"""Pool choice by context length and modality."""

from __future__ import annotations

import pytest

from gateway.backends.pool_params import PoolConfig
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.routing.features import RoutingRequest
from gateway.routing.pools import fitting_pools, larger_pools, output_room

POOLS = [
    PoolConfig(name="vllm-128k", engine="vllm", workers=["http://a:1"], max_context_tokens=131072,
               default_output_tokens=4096),
    PoolConfig(name="ascend-128k", engine="ascend", workers=["http://b:1"], max_context_tokens=131072,
               modalities=["text"]),
    PoolConfig(name="sglang-512k", engine="sglang", workers=["http://c:1"], max_context_tokens=524288,
               default_output_tokens=8192),
    PoolConfig(name="nvl72-1m", engine="vllm", workers=["http://d:1"], max_context_tokens=1048576,
               default_output_tokens=8192),
]


def request(prompt: int, output: int | None = None, modalities: frozenset[str] = frozenset({"text"})) -> RoutingRequest:
    return RoutingRequest(api="chat", model="kimi-k3", prompt_tokens=prompt, output_tokens=output, stream=False,
                          modalities=modalities, estimate_method="bytes")


@pytest.mark.parametrize(("prompt", "output", "first"), [
    (100, None, "vllm-128k"),
    (131072 - 4096, None, "vllm-128k"),          # exactly the reservation
    (131072 - 4095, None, "ascend-128k"),        # ascend reserves the default 1024
    (131072 - 1024, None, "ascend-128k"),
    (131072 - 1023, None, "sglang-512k"),
    (131072 - 10, 10, "vllm-128k"),
    (131072 - 10, 11, "sglang-512k"),
    (524288 - 8192, None, "sglang-512k"),        # SGLang 0.5.23 serves one that fills its context exactly
    (524288 - 8191, None, "nvl72-1m"),
    (524288 - 101, 100, "sglang-512k"),
    (1048576 - 1, 1, "nvl72-1m"),
])
def test_cheapest_fitting_pool_first(prompt: int, output: int | None, first: str) -> None:
    assert fitting_pools(request(prompt, output), POOLS)[0].name == first


def test_all_fitting_pools_are_returned_in_cost_order() -> None:
    assert [p.name for p in fitting_pools(request(1000), POOLS)] == [p.name for p in POOLS]


def test_images_skip_text_only_pools() -> None:
    """The text-only Ascend pool is skipped. vllm-128k, whose context cannot hold the prompt and the
    4096-token reservation, comes last: vLLM would serve it with a shorter output, so it is a
    fallback, no longer left out (it was, when the gateway required prompt + output on every engine)."""
    names = [p.name for p in fitting_pools(request(131072 - 1023, modalities=frozenset({"text", "image"})), POOLS)]
    assert names == ["sglang-512k", "nvl72-1m", "vllm-128k"]


VLLM_ONLY = [POOLS[0], POOLS[3]]
SGLANG_ONLY = [POOLS[2]]


def test_vllm_pool_serves_a_prompt_that_fits_with_an_output_limit_that_does_not() -> None:
    """Claude Code's `max_tokens: 32000` with a 120K-token prompt: no pool of the 128K one holds both,
    but vLLM 0.32 clamps the output to what the context leaves (finish_reason "length"), so the
    gateway routes it there instead of answering context_length_exceeded."""
    assert [p.name for p in fitting_pools(request(120_000, 32_000), [POOLS[0]])] == ["vllm-128k"]
    # a pool that holds it whole goes first, the clamping one stays a fallback
    assert [p.name for p in fitting_pools(request(120_000, 32_000), VLLM_ONLY)] == ["nvl72-1m", "vllm-128k"]
    # with no output limit the reservation does not have to fit either: the engine generates what is left
    assert [p.name for p in fitting_pools(request(131_000), [POOLS[0]])] == ["vllm-128k"]


def test_vllm_pool_still_refuses_what_vllm_refuses() -> None:
    for prompt, output in ((131_072, 1), (131_072, None), (10, 131_073)):  # the prompt fills it; limit > context
        with pytest.raises(ContextLengthExceeded):
            fitting_pools(request(prompt, output), [POOLS[0]])


def test_sglang_pool_needs_prompt_and_output_to_fit() -> None:
    """SGLang 0.5.23 refuses input + max_new_tokens over its context: no clamping there."""
    assert fitting_pools(request(524_288 - 100, 100), SGLANG_ONLY)[0].name == "sglang-512k"
    with pytest.raises(ContextLengthExceeded) as info:
        fitting_pools(request(524_288 - 100, 101), SGLANG_ONLY)
    assert "524289" in info.value.message and "101 output tokens" in info.value.message
    # ... and the gateway spills to a pool whose engine serves it
    assert [p.name for p in fitting_pools(request(524_288 - 100, 101), POOLS)] == ["nvl72-1m"]


def test_reservation_is_what_the_pool_can_generate() -> None:
    """The quota reserves min(requested output, what the chosen pool's context leaves)."""
    big = request(120_000, 32_000)
    room = output_room(POOLS[0], big)
    assert room == 131_072 - 120_000
    assert big.reserved_output(4096, room) == room and big.quota_tokens(4096, room) == 120_000 + room
    assert request(1000, 500).reserved_output(4096, output_room(POOLS[0], request(1000, 500))) == 500


def test_over_the_largest_pool() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        fitting_pools(request(1048576, 1), POOLS)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert "1048576" in info.value.message and "1048577" in info.value.message


def test_modality_no_pool_accepts() -> None:
    with pytest.raises(InvalidRequest) as info:
        fitting_pools(request(10, modalities=frozenset({"text", "audio"})), POOLS)
    assert info.value.code == "unsupported_content_type"
    assert "audio" in info.value.message


def test_larger_pools_for_a_too_long_retry() -> None:
    assert [p.name for p in larger_pools(POOLS[0], POOLS)] == ["sglang-512k", "nvl72-1m"]
    assert larger_pools(POOLS[3], POOLS) == []
