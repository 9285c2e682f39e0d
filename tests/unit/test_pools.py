"""Pool choice by context length and modality."""

from __future__ import annotations

import pytest

from gateway.backends.pool_params import PoolConfig
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.routing.features import RoutingRequest
from gateway.routing.pools import fitting_pools, larger_pools

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
    (524288 - 8193, None, "sglang-512k"),
    (524288 - 8192, None, "nvl72-1m"),           # SGLang refuses a request that fills its context exactly
    (524288 - 101, 100, "sglang-512k"),
    (1048576 - 1, 1, "nvl72-1m"),
])
def test_cheapest_fitting_pool_first(prompt: int, output: int | None, first: str) -> None:
    assert fitting_pools(request(prompt, output), POOLS)[0].name == first


def test_all_fitting_pools_are_returned_in_cost_order() -> None:
    assert [p.name for p in fitting_pools(request(1000), POOLS)] == [p.name for p in POOLS]


def test_images_skip_text_only_pools() -> None:
    names = [p.name for p in fitting_pools(request(131072 - 1023, modalities=frozenset({"text", "image"})), POOLS)]
    assert names == ["sglang-512k", "nvl72-1m"]


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
