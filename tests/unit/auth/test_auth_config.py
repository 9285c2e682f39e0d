"""The `auth` and `cors` config sections: what is accepted, what is refused and where."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.auth.keys import hash_key
from gateway.config import parse_config
from gateway.config_base import explain_validation_error

POOL = {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 1000}
ALICE = {"name": "alice", "sha256": hash_key("sk-alice-" + "x" * 32), "requests_per_minute": 60,
         "tokens_per_minute": 100_000}


def config(**sections: Any) -> Any:
    return parse_config({"pools": [POOL], **sections}, environ={})


def error(**sections: Any) -> str:
    with pytest.raises(ValidationError) as info:
        config(**sections)
    return explain_validation_error(info.value)


def test_defaults_are_off() -> None:
    c = config()
    assert (c.auth.enabled, c.auth.keys, c.auth.fail_mode, c.cors.enabled) == (False, [], "open", False)


def test_a_full_auth_section() -> None:
    c = config(auth={"enabled": True, "fail_mode": "closed", "keys": [
        {**ALICE, "sha256": ALICE["sha256"].upper()},
        {"name": "ops", "sha256": hash_key("sk-ops-" + "y" * 32), "scopes": ["user", "admin"]},
    ]})
    alice, ops = c.auth.keys
    assert alice.sha256 == ALICE["sha256"]  # normalised to lowercase
    assert (alice.scopes, alice.requests_per_minute, alice.tokens_per_minute) == (["user"], 60, 100_000)
    assert (ops.scopes, ops.requests_per_minute, ops.tokens_per_minute) == (["admin", "user"], None, None)


def test_key_hashes_from_the_environment() -> None:
    data = {"pools": [POOL], "auth": {"enabled": True, "keys": [{"name": "alice", "sha256": "${ALICE_SHA256}"}]}}
    c = parse_config(data, environ={"ALICE_SHA256": ALICE["sha256"]})
    assert c.auth.keys[0].sha256 == ALICE["sha256"]


def test_the_whole_section_from_the_environment() -> None:
    environ = {"KIMI_GATEWAY_AUTH": f'{{"enabled": true, "keys": [{{"name": "a", "sha256": "{"ab" * 32}"}}]}}'}
    c = parse_config({"pools": [POOL]}, environ=environ)
    assert c.auth.enabled and c.auth.keys[0].name == "a"


@pytest.mark.parametrize(("auth", "message"), [
    ({"enabled": True}, "auth: Value error, auth.enabled needs at least one key"),
    ({"keys": [{**ALICE, "sha256": "sk-the-key"}]}, "auth.keys.0.sha256: Value error, must be the key's SHA-256"),
    ({"keys": [{**ALICE, "sha256": "g" * 64}]}, "auth.keys.0.sha256: Value error"),
    ({"keys": [{**ALICE, "scopes": ["root"]}]}, "auth.keys.0.scopes.0: Input should be 'user', 'admin' or 'drain'"),
    ({"keys": [{**ALICE, "scopes": []}]}, "auth.keys.0.scopes: List should have at least 1 item"),
    ({"keys": [{**ALICE, "requests_per_minute": 0}]}, "auth.keys.0.requests_per_minute: Input should be greater"),
    ({"keys": [{**ALICE, "key": "sk-plain"}]}, "auth.keys.0.key: Extra inputs are not permitted"),
    ({"keys": [{**ALICE, "name": "alice smith"}]}, "auth.keys.0.name: String should match pattern"),
    ({"keys": [ALICE, {**ALICE, "sha256": "0" * 64}]}, "auth: Value error, key names must be unique"),
    ({"keys": [ALICE, {**ALICE, "name": "bob"}]}, "auth: Value error, two keys have the same sha256"),
    ({"fail_mode": "maybe"}, "auth.fail_mode: Input should be 'open' or 'closed'"),
])
def test_auth_errors_name_the_path(auth: dict[str, Any], message: str) -> None:
    assert error(auth=auth).startswith(message)


def test_cors_section() -> None:
    c = config(cors={"enabled": True, "allow_origins": ["https://chat.example.com/", "http://localhost:3000", "*"]})
    assert c.cors.allow_origins == ["https://chat.example.com", "http://localhost:3000", "*"]
    assert error(cors={"enabled": True}).startswith("cors: Value error, cors.enabled needs allow_origins")
    assert error(cors={"allow_origins": ["https://a.example.com/app"]}).startswith("cors.allow_origins: Value error")
    assert error(cors={"allow_origins": ["chat.example.com"]}).startswith("cors.allow_origins: Value error")
