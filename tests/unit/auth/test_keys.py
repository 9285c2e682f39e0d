"""API keys: hashing, bearer parsing, lookup by hash, the `hash-key` command."""

from __future__ import annotations

import io

import pytest

from gateway.auth.keys import KeyRing, Principal, bearer_token, hash_key
from gateway.auth.params import DEFAULT_COUNT_TOKENS_PER_MINUTE, ApiKeyConfig
from gateway.cli import main

KEY = "sk-test-0123456789abcdefghijklmnopqrstuv"


def test_hash_key_is_hex_sha256_of_utf8() -> None:
    # FIPS 180-2 test vector for "abc".
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert len(hash_key("ключ-🔑")) == 64


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"),
    ("bearer abc", "abc"),
    ("BEARER   abc  ", "abc"),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer   ", None),
    ("Basic dXNlcjpwYXNz", None),
    ("abc", None),
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_key_ring_finds_keys_by_hash_only() -> None:
    ring = KeyRing([
        ApiKeyConfig(name="alice", sha256=hash_key(KEY).upper(), requests_per_minute=5),
        ApiKeyConfig(name="ops", sha256=hash_key("other-" + KEY), scopes=["admin", "user", "admin"]),
    ])
    assert len(ring) == 2
    alice = ring.lookup(KEY)
    # a limited key gets the default count_tokens limit (issue 25 §9); a key without limits gets none
    assert alice == Principal("alice", frozenset({"user"}), 5, None, DEFAULT_COUNT_TOKENS_PER_MINUTE)
    assert alice.limited and alice.has("user") and not alice.has("admin")
    ops = ring.lookup("other-" + KEY)
    assert ops is not None and ops.has("admin") and not ops.limited and ops.count_tokens_per_minute is None
    assert ring.lookup(KEY + "x") is None
    assert ring.lookup(hash_key(KEY)) is None  # the stored hash is not a key


def test_hash_key_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    main(["hash-key", KEY])
    out, err = capsys.readouterr()
    assert out.strip() == hash_key(KEY) and err == ""

    monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
    main(["hash-key", "-"])
    assert capsys.readouterr().out.strip() == hash_key(KEY)

    main(["hash-key", "short"])
    out, err = capsys.readouterr()
    assert out.strip() == hash_key("short") and "warning" in err


def test_count_tokens_limit_defaults_only_for_limited_keys() -> None:
    digest = hash_key(KEY)
    assert ApiKeyConfig(name="a", sha256=digest, tokens_per_minute=10).count_tokens_limit == \
        DEFAULT_COUNT_TOKENS_PER_MINUTE
    assert ApiKeyConfig(name="a", sha256=digest, count_tokens_per_minute=7).count_tokens_limit == 7
    assert ApiKeyConfig(name="a", sha256=digest).count_tokens_limit is None
