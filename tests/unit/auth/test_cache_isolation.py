"""`auth.cache_isolation` and `auth.keys[].cache_group` (gateway/auth/cache_isolation.py): what the
config accepts, and the salts the keys get."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.auth.cache_isolation import cache_salt, salts
from gateway.auth.keys import hash_key
from gateway.config import parse_config
from gateway.config_base import explain_validation_error

POOL = {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 1000}


def key(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "sha256": hash_key(f"sk-{name}-" + "x" * 32), **fields}


def auth(**fields: Any) -> Any:
    return parse_config({"pools": [POOL], "auth": fields}, environ={}).auth


def test_off_by_default_and_no_salts() -> None:
    config = auth(enabled=True, keys=[key("alice")])
    assert config.cache_isolation == "off" and salts(config) == {}


def test_per_key_salts_each_key_and_a_group_shares_one() -> None:
    config = auth(enabled=True, cache_isolation="per_key",
                  keys=[key("alice", cache_group="acme"), key("carol", cache_group="acme"), key("bob")])
    assert salts(config) == {"alice": cache_salt("acme"), "carol": cache_salt("acme"), "bob": cache_salt("bob")}
    assert cache_salt("acme") != cache_salt("bob")


def test_a_salt_is_fixed_length_and_valid_for_vllm() -> None:
    for group in ("a", "acme", "x" * 64, "team.one_2-b"):
        salt = cache_salt(group)
        assert re.fullmatch(r"kgw-[0-9a-f]{32}", salt)  # vLLM: at most 128, no '@', '/', '\\', NUL


@pytest.mark.parametrize(("fields", "message"), [
    ({"enabled": False, "cache_isolation": "per_key"}, "it needs auth.enabled"),
    ({"enabled": True, "keys": [key("alice", cache_group="acme")]}, "only auth.cache_isolation: per_key uses"),
    ({"enabled": True, "cache_isolation": "per_tenant", "keys": [key("alice")]}, "cache_isolation"),
    ({"enabled": True, "cache_isolation": "per_key", "keys": [key("alice", cache_group="a/b")]}, "cache_group"),
])
def test_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        auth(**fields)
    assert message in explain_validation_error(info.value)
