"""Keys, config builders and a private redis-server for the auth tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from gateway.auth.keys import hash_key

REDIS_URL = "redis://127.0.0.1:6379/0"
ALICE_KEY = "sk-alice-" + uuid.uuid4().hex + uuid.uuid4().hex
OPS_KEY = "sk-ops-" + uuid.uuid4().hex + uuid.uuid4().hex
ENGINE_KEY = "engine-secret-" + uuid.uuid4().hex


def auth_section(alice: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """An enabled `auth` config: `alice` (user scope, extra fields from `alice`) and `ops` (user + admin)."""
    return {"enabled": True, **settings, "keys": [
        {"name": "alice", "sha256": hash_key(ALICE_KEY), **(alice or {})},
        {"name": "ops", "sha256": hash_key(OPS_KEY), "scopes": ["user", "admin"]},
    ]}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    """A fresh Redis key prefix; its keys are deleted from the shared Redis afterwards."""
    prefix = f"test-rl-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
