"""Issue 11 §11: Sentinel as a `redis+sentinel://` URL or a `redis:` block (parsing, errors, rendering)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from pydantic import ValidationError

from gateway.config import parse_config
from gateway.config_base import explain_validation_error
from gateway.redis_client import SentinelTarget, parse_sentinel_url

POOLS = [{"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 8192}]


def config(**settings: Any) -> Any:
    return parse_config({"pools": POOLS, **settings}, environ={})


def test_a_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    target = parse_sentinel_url("redis+sentinel://:p%40ss@10.0.0.1,10.0.0.2:26380,[::1]:26381/kgw/2"
                                "?sentinel_password=s%2Fpw")
    assert target == SentinelTarget((("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)), "kgw", 2,
                                    None, "p@ss", "s/pw")
    assert parse_sentinel_url(target.url()) == target  # rendering round-trips, odd characters included


def test_the_redis_block_becomes_the_url_every_store_reads() -> None:
    block = {"sentinels": ["sentinel-0.redis:26379", "sentinel-1.redis"], "service_name": "kgw", "db": 1,
             "password": "pw:1", "sentinel_password": "spw"}
    cfg = config(redis=block)
    assert cfg.redis_url is not None
    assert parse_sentinel_url(cfg.redis_url) == SentinelTarget(
        (("sentinel-0.redis", 26379), ("sentinel-1.redis", 26379)), "kgw", 1, None, "pw:1", "spw")
    assert "pw:1" not in repr(cfg.redis)  # secrets stay hidden in the block


@pytest.mark.parametrize(("settings", "message"), [
    ({"redis_url": "redis+sentinel://10.0.0.1:26379"}, "the path must be /SERVICE"),
    ({"redis_url": "redis+sentinel:///kgw"}, "no sentinel address"),
    ({"redis_url": "redis+sentinel://h:99999/kgw"}, "port must be 1-65535"),
    ({"redis_url": "redis+sentinel://h/kgw/x"}, "database must be a number"),
    ({"redis_url": "redis+sentinel://h/kgw?ssl=1"}, "unknown URL parameters"),
    ({"redis_url": "sentinel://h/kgw"}, "redis+sentinel://"),
    ({"redis_url": "redis://127.0.0.1:6379/0", "redis": {"sentinels": ["h"], "service_name": "kgw"}}, "not both"),
    ({"redis": {"sentinels": [], "service_name": "kgw"}}, "redis.sentinels"),
    ({"redis": {"sentinels": ["h:1"], "service_name": "kgw", "tls": True}}, "redis.tls"),
])
def test_bad_sentinel_settings_are_refused_with_the_reason(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        config(**settings)
    assert message in explain_validation_error(caught.value)


def test_a_wrong_sentinel_url_does_not_echo_its_password() -> None:
    with pytest.raises(ValidationError) as caught:
        config(redis_url="redis+sentinel://:hunter2@h/kgw/x")
    assert "hunter2" not in explain_validation_error(caught.value)


@pytest.mark.parametrize(("url", "warned"), [("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/kgw", True),
                                             ("redis+sentinel://10.0.0.1,10.0.0.2,10.0.0.3/kgw", False)])
def test_check_config_judges_a_sentinel_url_by_its_sentinels(url: str, warned: bool) -> None:
    from gateway.plans.safety import production_findings

    tree = {"pools": POOLS, "replicas": 2, "redis_url": url}
    findings = production_findings(tree, config(replicas=2, redis_url=url), environ={})
    assert any("2 gateway replicas but Redis is on this host" in f.message for f in findings) is warned


@pytest.mark.parametrize("password", ["Sup3rS3cret/xyz", "Sup3rS3cret#xyz", "Sup3rS3cret?xyz"])
def test_a_password_with_a_reserved_character_is_refused_without_echoing_it(password: str) -> None:
    # `redis+sentinel://:${REDIS_PASSWORD}@...` with a generated password holding '/', '#' or '?':
    # the URL splits inside the password, and the error must not put a piece of it in the log.
    url = "redis+sentinel://:${REDIS_PASSWORD}@s0:26379,s1:26379/kgw-primary/0"
    with pytest.raises(ValidationError) as caught:
        parse_config({"pools": POOLS, "redis_url": url}, environ={"REDIS_PASSWORD": password})
    message = explain_validation_error(caught.value)
    assert "Sup3r" not in message and "xyz" not in message
    assert "percent-encode" in message
    encoded = parse_config({"pools": POOLS, "redis_url": url},
                           environ={"REDIS_PASSWORD": quote(password, safe="")}).redis_url
    assert parse_sentinel_url(encoded).password == password
    plain = parse_sentinel_url("redis+sentinel://s0/kgw?sentinel_password=a%40b")  # '@' encoded in the query
    assert plain.sentinel_password == "a@b"
    assert parse_sentinel_url("redis+sentinel://s0/kgw?sentinel_password=a@b").sentinel_password == "a@b"
