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


def test_the_longest_request_is_a_pool_s_whole_context_generated_or_prefilled() -> None:
    # A request without an output limit generates to the end of the context: 60 s first byte + 60 s
    # generation + 0.1 s x 1,048,576 tokens; the whole context as prompt is the other end (60 + 524.288 + 60).
    assert longest_request_seconds(config()) == pytest.approx(60 + 60 + 104857.6)
    assert grace_period_seconds(config()) == 104993  # ceil(drain_delay 5 + 104,977.6 + margin 10)
    assert grace_period_seconds(config(), pre_stop_s=5) == 104998
    # a prefill slower than the generation: the whole context as prompt is the longest
    slow = config(timeouts={"first_byte_base": 10, "first_byte_per_1k_tokens": 1.0, "generation": 5,
                            "generation_per_token": 0.0001}, shutdown={"drain_delay": 2, "grace_period": 30})
    assert longest_request_seconds(slow) == pytest.approx(10 + 1048.576 + 5)
    assert grace_period_seconds(slow) == 1076  # ceil(2 + 1063.576 + 10)
    # the pools' default_output_tokens (the quota's reservation) do not bound what the engine generates
    chatty = [pool("small", "vllm", ["http://127.0.0.1:1"], 131072, default_output_tokens=100000),
              pool("large", "vllm", ["http://127.0.0.1:2"], 1048576, default_output_tokens=1024)]
    assert longest_request_seconds(parse_config({"pools": chatty}, environ={})) == pytest.approx(
        60 + 60 + 104857.6)


def test_the_total_cap_and_a_longer_shutdown_grace_period_bound_it() -> None:
    assert longest_request_seconds(config(timeouts={"total": 600})) == 600
    assert grace_period_seconds(config(timeouts={"total": 600}), pre_stop_s=5) == 5 + 5 + 600 + 10
    # the gateway lets in-flight requests run shutdown.grace_period: the pod outlasts it
    assert grace_period_seconds(config(timeouts={"total": 600}, shutdown={"drain_delay": 5, "grace_period": 3600}),
                                pre_stop_s=5) == 3620


def test_the_shipped_production_config() -> None:
    shipped = load_config(REPO_ROOT / "config" / "k3-production.yaml",
                          {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64})
    assert longest_request_seconds(shipped) == 3600  # its timeouts.total, as the docstring says
    assert grace_period_seconds(shipped, pre_stop_s=5) == 3620
