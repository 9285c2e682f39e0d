"""Per-key allowed models and per-key, per-model limits (issue 22): a key's `models` and
`model_limits` entries resolved as requests are (an alias is its model), the 404 a key gets for a
model it may not use, and both the key's and the model's limits on the in-process limiter."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.auth.access import allowed_models, canonical, model_names, model_not_found_message
from gateway.auth.guard import AuthGuard, Reservation
from gateway.auth.keys import KeyRing, Principal, hash_key, model_key, principal_of
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.params import ApiKeyConfig, AuthConfig
from gateway.config import parse_config
from gateway.errors import ModelNotFound, RateLimited
from gateway.observability.metrics import GatewayMetrics

KEY = "sk-alice-" + "k" * 32
CONFIG = parse_config({"model": {"name": "kimi-k3", "aliases": ["Kimi-K3", "moonshotai/Kimi-K3"]},
                       "pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                  "workers": ["http://a:1"], "lora_adapters": ["sql-lora"]}]}, environ={})


class Clock:
    """A settable clock (seconds) for the in-process limiter."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(**fields: Any) -> ApiKeyConfig:
    return ApiKeyConfig(name="alice", sha256=hash_key(KEY), **fields)


def guard(alice: ApiKeyConfig, clock: Clock | None = None) -> AuthGuard:
    config = AuthConfig(enabled=True, keys=[alice])
    return AuthGuard(config, KeyRing([alice], model_names(CONFIG)), MemoryRateLimiter(clock=clock or Clock()),
                     GatewayMetrics())


def sample(g: AuthGuard, name: str, **labels: str) -> float:
    return g.metrics.registry.get_sample_value(name, labels) or 0.0


def test_names_resolve_as_requests_do() -> None:
    names = model_names(CONFIG)
    assert names == {"kimi-k3": "kimi-k3", "moonshotai/kimi-k3": "kimi-k3"}  # case-insensitive, as requests
    assert [canonical(n, names) for n in ("KIMI-k3", "moonshotai/Kimi-K3", "sql-lora", "SQL-lora")] == [
        "kimi-k3", "kimi-k3", "sql-lora", "SQL-lora"]  # adapters are exact, as the engines list them
    assert allowed_models(None, names) is None
    assert allowed_models(["Kimi-K3", "sql-lora"], names) == frozenset({"kimi-k3", "sql-lora"})
    assert model_not_found_message("x" * 300) == f"The model `{'x' * 200}` does not exist or you do not have " \
                                                 "access to it."


def test_names_of_several_models() -> None:
    config = parse_config({"models": [{"name": "kimi-k3", "aliases": ["K3"], "pools": ["p"]},
                                      {"name": "qwen3-8b", "aliases": ["small"], "pools": ["p"]}],
                           "pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"]}]}, environ={})
    names = model_names(config)
    assert names == {"kimi-k3": "kimi-k3", "k3": "kimi-k3", "qwen3-8b": "qwen3-8b", "small": "qwen3-8b"}
    alice = principal_of(key(models=["SMALL"], model_limits={"k3": {"requests_per_minute": 1}}), names)
    assert alice.models == frozenset({"qwen3-8b"}) and list(alice.model_limits) == ["kimi-k3"]


def test_a_keys_models_and_model_limits_are_resolved_to_canonical_names() -> None:
    alice = principal_of(key(models=["moonshotai/Kimi-K3", "sql-lora"], requests_per_minute=9,
                             model_limits={"Kimi-K3": {"tokens_per_minute": 500}, "sql-lora": {}}),
                         model_names(CONFIG))
    assert alice.models == frozenset({"kimi-k3", "sql-lora"})
    assert alice.may_use("kimi-k3") and alice.may_use("sql-lora") and not alice.may_use("other-lora")
    assert list(alice.model_limits) == ["kimi-k3"]  # an entry without limits limits nothing
    limits = alice.model_limits["kimi-k3"]
    assert (limits.name, limits.requests_per_minute, limits.tokens_per_minute) == (
        model_key("alice", "kimi-k3"), None, 500) == ("alice/model/kimi-k3", None, 500)
    assert alice.limits_tokens("kimi-k3") and not alice.limits_tokens("sql-lora") and not alice.limits_tokens(None)
    everyone = principal_of(key(), model_names(CONFIG))
    assert everyone.models is None and everyone.may_use("anything") and everyone.model_limits == {}
    hash(alice)  # a Principal stays hashable with its per-model limits
    with pytest.raises(ValueError, match="names 'kimi-k3' twice"):
        principal_of(key(model_limits={"kimi-k3": {"requests_per_minute": 1}, "Kimi-K3": {"requests_per_minute": 2}}),
                     model_names(CONFIG))


def test_config_shapes() -> None:
    assert key().models is None and key().model_limits == {}
    with pytest.raises(ValidationError, match="models must be distinct"):
        key(models=["a", "a"])
    with pytest.raises(ValidationError):
        key(models=[""])
    with pytest.raises(ValidationError):
        key(model_limits={"kimi-k3": {"requests_per_minute": 0}})
    with pytest.raises(ValidationError):
        key(model_limits={"kimi-k3": {"rpm": 3}})  # a typo is an error, not a silent no-limit


def test_a_model_the_key_may_not_use_is_openais_404() -> None:
    g = guard(key(models=["kimi-k3"]))
    alice = g.keys.lookup(KEY)
    assert alice is not None
    g.check_model(alice, "kimi-k3")
    with pytest.raises(ModelNotFound) as refused:
        g.check_model(alice, "sql-lora")
    assert refused.value.status == 404
    assert refused.value.body() == {"error": {
        "message": "The model `sql-lora` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert sample(g, "kimi_gateway_auth_failures_total", reason="model") == 1


@pytest.mark.anyio
async def test_both_the_keys_and_the_models_limits_apply() -> None:
    clock = Clock()
    g = guard(key(requests_per_minute=3, model_limits={"kimi-k3": {"requests_per_minute": 2}}), clock)
    alice = g.keys.lookup(KEY)
    assert alice is not None
    for _ in range(2):
        counted = await g.count_request(alice)
        reservation = await g.check_quota(alice, 10, requests=0, counted=counted, model="kimi-k3")
        assert reservation is not None and reservation.model is not None
    counted = await g.count_request(alice)
    with pytest.raises(RateLimited) as per_model:  # the model's limit: 2 a minute
        await g.check_quota(alice, 10, requests=0, counted=counted, model="kimi-k3")
    assert per_model.value.message.startswith(
        "Rate limit reached for kimi-k3 for API key alice on requests per min (RPM): Limit 2, Used 2, Requested 1.")
    assert sample(g, "kimi_gateway_model_rate_limited_total", key=g.metric_labels["alice"],
                  model="kimi-k3", limit="requests") == 1
    assert sample(g, "kimi_gateway_rate_limited_total", key=g.metric_labels["alice"], limit="requests") == 1
    # the key's own third request of the minute went to the model's refusal; another model is free
    # of the model's limit but not of the key's: its 4th request is refused by the key's limit
    with pytest.raises(RateLimited) as key_wide:
        await g.count_request(alice)
    assert key_wide.value.message.startswith("Rate limit reached for API key alice on requests per min (RPM)")
    clock.now = 120.0  # two windows on: all clear
    assert await g.check_quota(alice, 10, requests=1, model="sql-lora") is not None


@pytest.mark.anyio
async def test_a_refusal_by_the_models_tokens_gives_the_keys_tokens_back() -> None:
    clock = Clock()
    g = guard(key(tokens_per_minute=1000, model_limits={"kimi-k3": {"tokens_per_minute": 100}}), clock)
    alice = g.keys.lookup(KEY)
    assert alice is not None
    first = await g.check_quota(alice, 80, requests=0, model="kimi-k3")
    assert first is not None and first.model is not None and (first.tokens, first.model.tokens) == (80, 80)
    with pytest.raises(RateLimited) as refused:
        await g.check_quota(alice, 80, requests=0, model="kimi-k3")
    assert refused.value.headers["retry-after"]
    assert refused.value.message.startswith("Rate limit reached for kimi-k3 for API key alice on tokens per min")
    # the key kept only the first request's 80 tokens: 920 more still fit on another model
    assert await g.check_quota(alice, 920, requests=0, model="sql-lora") is not None
    with pytest.raises(RateLimited):
        await g.check_quota(alice, 1, requests=0, model="sql-lora")


@pytest.mark.anyio
async def test_settling_settles_the_models_reservation_too() -> None:
    clock = Clock()
    g = guard(key(model_limits={"kimi-k3": {"tokens_per_minute": 100, "requests_per_minute": 1}}), clock)
    alice = g.keys.lookup(KEY)
    assert alice is not None
    # no limit of the key's own: the model's reservation is the one returned
    reservation = await g.check_quota(alice, 90, requests=0, model="kimi-k3")
    assert isinstance(reservation, Reservation) and reservation.principal.name == "alice/model/kimi-k3"
    await g.settle(reservation, None)  # no engine worked on it: request and tokens back
    again = await g.check_quota(alice, 90, requests=0, model="kimi-k3")
    assert again is not None
    await g.settle(again, 20)  # it used 20: 80 of the model's tokens come back, its request stays
    with pytest.raises(RateLimited) as refused:
        await g.check_quota(alice, 10, requests=0, model="kimi-k3")
    assert refused.value.message.startswith("Rate limit reached for kimi-k3 for API key alice on requests per min")
    assert await g.check_quota(alice, 10**6, requests=0, model="sql-lora") is None  # no limit there


@pytest.mark.anyio
async def test_a_models_count_tokens_limit_applies_to_count_tokens_requests_only() -> None:
    g = guard(key(model_limits={"kimi-k3": {"count_tokens_per_minute": 1}}))
    alice = g.keys.lookup(KEY)
    assert alice is not None
    assert await g.check_quota(alice, 0, requests=0, model="kimi-k3", counting=True) is None
    with pytest.raises(RateLimited) as refused:
        await g.check_quota(alice, 0, requests=0, model="kimi-k3", counting=True)
    assert not math.isinf(float(refused.value.headers["retry-after"]))
    assert await g.check_quota(alice, 50, requests=0, model="kimi-k3") is None  # generation is not limited


def test_key_names_cannot_meet_a_models_limiter_name() -> None:
    with pytest.raises(ValidationError):
        ApiKeyConfig(name="alice/model/kimi-k3", sha256=hash_key(KEY))
    assert Principal("a", frozenset()).may_use("x")


def test_a_limit_on_a_model_the_key_may_not_use_is_logged_as_moot(caplog: pytest.LogCaptureFixture) -> None:
    auth = {"enabled": True, "keys": [{"name": "alice", "sha256": hash_key(KEY), "models": ["Kimi-K3"],
                                       "model_limits": {"moonshotai/Kimi-K3": {"requests_per_minute": 1},
                                                        "sql-lora": {"requests_per_minute": 1}}}]}
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"], "lora_adapters": ["sql-lora"]}],
                           "auth": auth}, environ={})
    with caplog.at_level(logging.WARNING, logger="gateway.auth"):
        built = AuthGuard.build(config, GatewayMetrics())
    assert built is not None
    moot = [r.getMessage() for r in caplog.records if r.name == "gateway.auth"]
    assert moot == ["auth.keys alice: model_limits names 'sql-lora', which its models leave out: moot"]
