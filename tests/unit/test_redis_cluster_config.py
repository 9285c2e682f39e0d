"""Issue 26 §8: Redis Cluster as a `redis+cluster://` URL (parsing, errors, the client it builds)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config import parse_config
from gateway.config_base import explain_validation_error
from gateway.redis_client import redis_from_url
from gateway.redis_cluster import ClusterTarget, GatewayCluster, parse_cluster_url

POOLS = [{"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 8192}]


def config(**settings: Any) -> Any:
    return parse_config({"pools": POOLS, **settings}, environ={})


def test_a_cluster_url_names_start_up_nodes_and_credentials() -> None:
    assert parse_cluster_url("redis+cluster://kgw:p%40ss@10.0.0.1,10.0.0.2:7001,[::1]:7002") == ClusterTarget(
        (("10.0.0.1", 6379), ("10.0.0.2", 7001), ("::1", 7002)), "kgw", "p@ss", False)
    assert parse_cluster_url("rediss+cluster://:pw@redis-0.redis:6380/0") == ClusterTarget(
        (("redis-0.redis", 6380),), None, "pw", True)
    assert config(redis_url="redis+cluster://10.0.0.1:7000").redis_url == "redis+cluster://10.0.0.1:7000"


def test_the_stores_get_a_cluster_client_with_their_own_timeouts() -> None:
    client = redis_from_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", socket_timeout=2.5,
                            socket_connect_timeout=0.25, max_connections=32)
    assert isinstance(client, GatewayCluster)  # no I/O yet: nothing listens on these ports
    assert [node.port for node in client.startup_nodes] == [7000, 7001]
    assert client.connection_kwargs["socket_timeout"] == 2.5 and client.connection_kwargs["max_connections"] == 32


@pytest.mark.parametrize(("url", "message"), [
    ("redis+cluster://", "no node address"),
    ("redis+cluster://h:99999", "node port must be 1-65535"),
    ("redis+cluster://h:7000/1", "database 0 only"),
    ("redis+cluster://h:7000?read_from_replicas=1", "take no parameters"),
    ("cluster://h:7000", "redis+cluster://"),
])
def test_bad_cluster_urls_are_refused_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        config(redis_url=url)
    assert message in explain_validation_error(caught.value)


def test_a_wrong_cluster_url_does_not_echo_its_password() -> None:
    with pytest.raises(ValidationError) as caught:
        config(redis_url="redis+cluster://:hunter2@h:7000/3")
    assert "hunter2" not in explain_validation_error(caught.value)
