"""Redis Cluster for the stores (affinity, stored responses, rate limits, shared drains).

Selected by the URL scheme: `redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...][/0]`
(`rediss+cluster://` for TLS; port 6379 when left out; credentials percent-encoded). The hosts are
start-up nodes: the client asks the first that answers for the slot map (`CLUSTER SLOTS`) and then
sends each command to the primary that holds its key's slot, following `MOVED`/`ASK` redirections
and re-reading the map after a resharding or a failover (redis-py's `redis.asyncio.cluster.RedisCluster`).
A cluster has database 0 only. The name follows redis-py's and other clients' (`redis+sentinel`,
LiteLLM's `redis_startup_nodes`): a list of seed nodes, not one server.

Every store command touches one key, or keys of one slot: the rate limiter's script, the stored
responses' GET/SET and the drain set use one key each; the affinity store tags its keys with the
prompt's first block (`{key_prefix}:{pool}:{{first block hash}}:{block hash}`, the `{...}` part is the
Redis Cluster hash tag), so one prompt's lookup is one MGET and its record one script on one slot,
while different prompts spread over the cluster. Pipelines of writes (affinity, stored responses)
are split by node (one round trip per node, in parallel).

A plain `redis://` URL that names a cluster node would reach only the keys of that node's slots
(every other key answers `MOVED`): the gateway's plain connections ask `INFO cluster` when they
connect and refuse a node with `cluster_enabled:1` (`ClusterNodeError`, a connection error: the
stores count it, trip their circuit breakers and `kimi_gateway_redis_up` reads 0), and
`kimi-gateway check-config` reports it (`probe_cluster_node`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_PORT = 6379
# redis-py connection options that also apply to a cluster's node connections.
NODE_OPTIONS = ("socket_timeout", "socket_connect_timeout", "retry", "max_connections", "health_check_interval",
                "socket_keepalive", "client_name")


class ClusterNodeError(RedisConnectionError):
    """A plain `redis://` connection reached a Redis Cluster node: only the keys of its own slots would
    work, every other one would answer MOVED. Use a `redis+cluster://` URL."""


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """Start-up nodes of a cluster and its credentials; `tls` for `rediss+cluster://`."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


def is_cluster_url(url: str) -> bool:
    """True for a `redis+cluster://` or `rediss+cluster://` URL."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES and "://" in url


def parse_cluster_url(url: str) -> ClusterTarget:
    """Parse a `redis+cluster://` URL (shape in the module doc). Raises ValueError saying what is
    wrong (never echoing a password)."""
    from gateway.redis_client import sentinel_address

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError("not a redis+cluster:// URL")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if not at and "@" in url.partition("://")[2]:
        raise ValueError("the user or password holds '/', '?' or '#': percent-encode it "
                         "(urllib.parse.quote(secret, safe=''))")
    user, colon, secret = userinfo.partition(":")
    nodes = tuple(sentinel_address(item, CLUSTER_PORT, "node") for item in hostlist.split(",") if item.strip())
    if not nodes:
        raise ValueError("no node address (redis+cluster://HOST[:PORT][,HOST[:PORT]...])")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has database 0 only: leave the path out or give /0")
    if parts.query:
        raise ValueError("redis+cluster:// URLs take no parameters")
    return ClusterTarget(nodes, unquote(user) or None, unquote(secret) if colon else None, scheme == "rediss+cluster")


class GatewayCluster(RedisCluster):
    """redis-py's asyncio cluster client whose slot-map read (`CLUSTER SLOTS`, then `COMMAND`: a few
    milliseconds, more than an affinity lookup's budget) is not cut by a store's timeout: it runs as
    its own task, begun at construction when an event loop runs (the stores are built in the app's
    lifespan), which a caller's timeout leaves running, so the next call finds the map ready instead
    of every call starting it again and cancelling it half done."""

    _init_task: asyncio.Task[Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # built outside a loop: the first command reads the map
        self._start_init()

    def _start_init(self, *args: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = self._init_task
        if task is None or task.done():
            task = asyncio.ensure_future(RedisCluster.initialize(self, *args, **kwargs))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved"
            self._init_task = task
        return task

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        if self._initialize:
            await asyncio.shield(self._start_init(*args, **kwargs))
        return self

    async def aclose(self) -> None:
        if self._init_task is not None and not self._init_task.done():
            self._init_task.cancel()
        await super().aclose()


def cluster_from_url(url: str, **kwargs: Any) -> GatewayCluster:
    """A cluster client for a `redis+cluster://` URL (no I/O yet). `kwargs` are the stores' redis-py
    connection options (`socket_timeout`, `socket_connect_timeout` in seconds, `retry`, `max_connections`
    per node, ...); options of plain connections only (`connection_class`) are dropped. Raises ValueError
    for a malformed URL."""
    target = parse_cluster_url(url)
    options = {k: v for k, v in kwargs.items() if k in NODE_OPTIONS}
    return GatewayCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                          username=target.username, password=target.password, ssl=target.tls, **options)


def cluster_enabled(info: dict[str, Any] | bytes | str) -> bool:
    """Whether an `INFO cluster` answer (parsed by redis-py, or raw) says `cluster_enabled:1`."""
    if isinstance(info, dict):
        return str(info.get("cluster_enabled", 0)) == "1"
    text = info.decode() if isinstance(info, bytes) else info
    return "cluster_enabled:1" in text


async def probe_cluster_node(url: str, timeout: float = 1.0) -> bool | None:
    """Ask the Redis of a plain `redis://`/`rediss://` URL whether it is a cluster node (`INFO cluster`).
    True: it is (the URL should be `redis+cluster://`); False: it is not; None: it did not answer
    within `timeout` seconds, refused `INFO`, or the URL is not a plain one (nothing to tell)."""
    import redis.asyncio as aioredis

    if urlsplit(url).scheme.lower() not in ("redis", "rediss"):
        return None
    client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            return cluster_enabled(await client.info("cluster"))
    except (RedisError, OSError, TimeoutError):
        return None
    finally:
        await client.aclose()


async def refuse_cluster_node(connection: Any) -> None:
    """On a freshly connected plain connection: raise ClusterNodeError if its server is a cluster node.
    A server that refuses `INFO` (an ACL without it) is let through."""
    await connection.send_command("INFO", "cluster", check_health=False)
    try:
        answer = await connection.read_response()
    except ResponseError:
        return
    if cluster_enabled(answer):
        raise ClusterNodeError(f"{connection.host}:{connection.port} is a Redis Cluster node: a plain redis:// "
                               "URL reaches only the keys of its own slots; use redis+cluster://HOST:PORT[,...]")
