"""The stores' Redis connections pack commands with hiredis: the same RESP bytes as redis-py's own packer."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from gateway.redis_client import _DemotionAwareConnection, _DemotionAwareSSLConnection, _SentinelConnection

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "0123abcd", 1, "kgw:rl:alice", 60000, -1, 1_000_000_000, 512, "", 0),
    ("MGET", *(f"kgw:aff:pool:{h:016x}" for h in range(40))),
    ("SET", "kgw:k:é", "http://127.0.0.1:8001", "PX", 600000),
    ("SET", b"raw\x00bytes", memoryview(b"view"), 2.5, 10**30, -7),
    ("SCRIPT LOAD", "return 1"),  # a two-word name: split into two arguments, as redis-py does
]


@pytest.mark.parametrize("connection_class", [_DemotionAwareConnection, _DemotionAwareSSLConnection])
@pytest.mark.parametrize("args", COMMANDS)
def test_commands_pack_to_redis_pys_bytes(connection_class: type[Connection], args: tuple[Any, ...]) -> None:
    ours, theirs = connection_class(), Connection()
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


def test_sentinel_connections_pack_with_hiredis_too() -> None:
    assert _SentinelConnection.pack_command is _DemotionAwareConnection.pack_command


def test_arguments_redis_py_refuses_are_still_refused_by_it() -> None:
    for bad in (True, None):
        with pytest.raises(DataError):
            _DemotionAwareConnection().pack_command("SET", "k", bad)


def test_a_pipeline_packs_every_command_alike() -> None:
    ours, theirs = _DemotionAwareConnection(), Connection()
    assert b"".join(ours.pack_commands(COMMANDS)) == b"".join(theirs.pack_commands(COMMANDS))
