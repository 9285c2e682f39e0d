"""`grace_period_seconds` / `longest_request_seconds` (gateway/plans/safety.py): a gateway pod's
terminationGracePeriodSeconds from the config's timeouts and shutdown (issue 24 §4)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import load_config, parse_config
from gateway.plans.safety import grace_period_seconds, longest_request_seconds
from tests.support import REPO_ROOT, pool


def config(**settings: Any) -> Any:
    pools = [pool("small", "vllm", ["http://127.0.0.1:1"], 131072, default_output_tokens=4096),
             pool("large", "vllm", ["http://127.0.0.1:2"], 1048576, default_output_tokens=8192),
             pool("mid", "sglang", ["http://127.0.0.1:3"], 524288)]
    return parse_config({"pools": pools, **settings}, environ={})


def test_the_longest_request_is_a_pool_full_of_prompt_and_its_default_output() -> None:
    # 60 s first byte + 0.5 s per 1k of 1,048,576 prompt tokens + 60 s generation + 0.1 s x 8,192 tokens
    assert longest_request_seconds(config()) == pytest.approx(60 + 524.288 + 60 + 819.2)
    assert grace_period_seconds(config()) == 1479  # ceil(drain_delay 5 + 1,463.488 + margin 10)
    assert grace_period_seconds(config(), pre_stop_s=5) == 1484
    custom = config(timeouts={"first_byte_base": 10, "first_byte_per_1k_tokens": 1.0, "generation": 5,
                              "generation_per_token": 0.01}, shutdown={"drain_delay": 2, "grace_period": 30})
    assert longest_request_seconds(custom) == pytest.approx(10 + 1048.576 + 5 + 81.92)
    assert grace_period_seconds(custom) == 1158  # ceil(2 + 1145.496 + 10)
    # the pool with the most output allowance can be the longest although its context is not the largest
    chatty = [pool("small", "vllm", ["http://127.0.0.1:1"], 131072, default_output_tokens=100000),
              pool("large", "vllm", ["http://127.0.0.1:2"], 1048576, default_output_tokens=1024)]
    assert longest_request_seconds(parse_config({"pools": chatty}, environ={})) == pytest.approx(
        60 + 65.536 + 60 + 10000)


def test_the_total_cap_and_a_longer_shutdown_grace_period_bound_it() -> None:
    assert longest_request_seconds(config(timeouts={"total": 600})) == 600
    assert grace_period_seconds(config(timeouts={"total": 600}), pre_stop_s=5) == 5 + 5 + 600 + 10
    # the gateway lets in-flight requests run shutdown.grace_period: the pod outlasts it
    assert grace_period_seconds(config(timeouts={"total": 600}, shutdown={"drain_delay": 5, "grace_period": 3600}),
                                pre_stop_s=5) == 3620


def test_the_shipped_production_config() -> None:
    shipped = load_config(REPO_ROOT / "config" / "k3-production.yaml",
                          {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64})
    assert longest_request_seconds(shipped) == pytest.approx(1463.488)  # nvl72-1m, as the docstring says
    assert grace_period_seconds(shipped, pre_stop_s=5) == 1484
