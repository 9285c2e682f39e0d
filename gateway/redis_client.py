"""Redis clients of the stores (affinity, rate limits, shared drains): one plain Redis or a primary
found through Redis Sentinel, behind the same redis-py asyncio `Redis` interface.

`redis_url` takes redis-py's schemes (`redis://`, `rediss://`, `unix://`) or
`redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB][?sentinel_password=P]`
(sentinel port 26379 by default; PASSWORD is the primary's, `sentinel_password` the sentinels'; all
percent-encoded). The `redis:` block of the config (`RedisSentinelConfig`) is rendered to that URL.
`redis+cluster://HOST[:PORT][,HOST[:PORT]...]` is a Redis Cluster (gateway/redis_cluster.py); a plain
URL's connections refuse a cluster node (`ClusterNodeError`) instead of reaching a third of the keys.

With Sentinel, redis-py's `SentinelConnectionPool` asks the sentinels for the primary's address
whenever it opens a connection, and a connection whose command answers `READONLY` (the primary it
talks to was demoted to a replica) is dropped with a ConnectionError, so the store's circuit breaker
skips Redis for its `retry_after` and the next connection goes to the new primary. Reads alone do
not answer `READONLY` on a demoted primary, so the pool here also asks the sentinels, at most every
`RECHECK_S` seconds and in the background (a command never waits for a sentinel), where the primary
is, and drops idle connections to any other address: a store that only reads (drain sync) also
moves to the new primary within seconds of a failover. After a quiet spell (no command for
`STALE_S`) that background check would come too late for the first commands, so the stores call
`primary_known()` before each call (outside its Redis budget): it asks the sentinels first, waiting
at most `CHECK_WAIT_S`. A command refused with `READONLY` raises `PrimaryDemoted`, which the
stores' `retry` resends once on a new connection (`DEMOTED_RETRY`, `STALE_CONNECTION_RETRY`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, ConnectionPool, SSLConnection
from redis.asyncio.observability.recorder import _get_or_create_collector
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.event import AsyncAfterConnectionReleasedEvent
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError

from gateway.redis_cluster import cluster_from_url, host_port, is_cluster_url, refuse_cluster_node

log = logging.getLogger("gateway.redis")

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
RECHECK_S = 1.0
CLOSE_WAIT_S = 0.5
"""The longest a store's shutdown waits for its Redis sockets to close (seconds)."""
STALE_S = RECHECK_S
CHECK_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """Where the primary is found: sentinel addresses, the monitored service's name (the `master`
    name in sentinel.conf), the database number and the credentials (primary's, sentinels')."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    def url(self) -> str:
        """The `redis+sentinel://` URL of this target (credentials percent-encoded)."""
        auth = ""
        if self.username is not None or self.password is not None:
            auth = quote(self.username or "", safe="") + (
                ":" + quote(self.password, safe="") if self.password is not None else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
        query = f"?sentinel_password={quote(self.sentinel_password, safe='')}" if self.sentinel_password else ""
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{quote(self.service_name, safe='')}/{self.db}{query}"


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a `redis+sentinel://` URL (shape in the module doc). Raises ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL")
    if "@" not in parts.netloc and "@" in url.partition("://")[2].split("?sentinel_password=", 1)[0]:
        # A credential holding '/', '?' or '#' ended the host list inside itself; naming what was
        # parsed would print a piece of the password.
        raise ValueError("the user or password holds '/', '?' or '#': percent-encode it "
                         "(urllib.parse.quote(secret, safe='')) or give it in the `redis:` block")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if _:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(sentinel_address(item) for item in hostlist.split(",") if item.strip())
    if not sentinels:
        raise ValueError("no sentinel address (redis+sentinel://HOST[:PORT][,HOST[:PORT]...]/SERVICE)")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("the path must be /SERVICE or /SERVICE/DB (the service name the sentinels monitor)")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ValueError(f"the database must be a number, got {path[1]!r}")
        db = int(path[1])
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"unknown URL parameters {sorted(unknown)} (only sentinel_password)")
    sentinel_password = query.get("sentinel_password", [None])[-1] or None
    return SentinelTarget(sentinels, path[0], db, username, password, sentinel_password)


def sentinel_address(item: str, default_port: int = SENTINEL_PORT, what: str = "sentinel") -> tuple[str, int]:
    """`host[:port]` or `[v6]:port` → (host, port), `default_port` (26379) when left out; `what` names
    the address in errors. Raises ValueError (`gateway.redis_cluster.host_port`)."""
    return host_port(item, default_port, what)


class PrimaryDemoted(RedisConnectionError):
    """A command answered `READONLY`: the server this connection reached is a replica now. The
    connection was dropped, and the command was refused before it changed anything, so it is safe
    to send again on a new connection (`DEMOTED_RETRY`), which finds the primary anew."""


DEMOTED_RETRY = Retry(NoBackoff(), 1, supported_errors=(PrimaryDemoted,))
"""redis-py `retry` for a store that must not resend a command that may have run (a rate-limit
count): only a command refused with `READONLY` is sent again, once, at once."""


class _HiredisPacking:
    """Commands packed into RESP by hiredis (C) instead of redis-py's asyncio `pack_command`, a
    Python loop over the arguments (redis-py's synchronous client packs with hiredis when it is
    installed: `redis/connection.py`, `HiredisRespSerializer`; its asyncio connection never does).
    The same bytes for the arguments the stores send (str as UTF-8, int, float, bytes); anything
    else (a multi-word command name, an argument type hiredis refuses) goes to redis-py's packer,
    which raises its own errors. A mixin before redis-py's `Connection` in the bases."""

    def pack_command(self, *args: Any) -> list[bytes]:
        name = args[0] if args else None
        if isinstance(name, str) and " " not in name:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:  # bool, None, bytearray...: redis-py's packer says what is wrong
                pass
        return super().pack_command(*args)  # type: ignore[misc,no-any-return]  # redis-py's Connection


class _LeanPool(ConnectionPool):
    """redis-py's asyncio pool, without its per-call observability bookkeeping while that is off
    (no OpenTelemetry metrics configured through redis-py: `redis/asyncio/observability/recorder.py`
    then records nothing, but `get_connection` and `release` still make five calls a command to
    find that out). With it on, redis-py's own methods run. Otherwise the same steps in the same
    order: `get_connection`, `release` of redis-py 8.1's `ConnectionPool`."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if _redis_metrics() is not None:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        async with self._lock:
            connection = self.get_available_connection()  # type: ignore[no-untyped-call]
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: Any) -> None:
        if _redis_metrics() is not None:
            await super().release(connection)
            return
        async with self._lock:
            self._in_use_connections.remove(connection)
            if connection.should_reconnect():
                await connection.disconnect()
            self._available_connections.append(connection)
        dispatcher = self._event_dispatcher
        assert dispatcher is not None  # redis-py's pool always sets one
        await dispatcher.dispatch_async(AsyncAfterConnectionReleasedEvent(connection))  # type: ignore[no-untyped-call]


def _redis_metrics() -> Any:
    """redis-py's metrics collector, None while its observability is off (the gateway's case)."""
    return _get_or_create_collector()


class _DemotionAwareConnection(_HiredisPacking, Connection):
    """A plain `redis://` connection that drops itself on `READONLY`, as redis-py's Sentinel
    connections do: behind a DNS name that follows the primary (a cloud's primary endpoint, a
    Kubernetes Service) the next connection resolves the name again and reaches the new primary."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ReadOnlyError:
            await self.disconnect()
            raise PrimaryDemoted(f"{self.host}:{self.port} answered READONLY: no longer the primary") from None

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        await super().on_connect_check_health(check_health=check_health)
        await refuse_cluster_node(self)  # a cluster node behind a plain URL: refused (gateway/redis_cluster.py)


class _SentinelConnection(_HiredisPacking, SentinelManagedConnection):
    """redis-py's Sentinel connection, raising PrimaryDemoted (not a bare ConnectionError) on
    `READONLY`, so that `DEMOTED_RETRY` resends the command to the primary the sentinels name now."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await Connection.read_response(self, *args, **kwargs)
        except ReadOnlyError:
            await self.disconnect()
            raise PrimaryDemoted(f"{self.host}:{self.port} answered READONLY: no longer the primary") from None


class _DemotionAwareSSLConnection(_DemotionAwareConnection, SSLConnection):
    pass


class _WatchedSentinelPool(SentinelConnectionPool):
    """redis-py's Sentinel pool that also re-resolves the primary in the background (module doc)."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self._next_check = 0.0
        self._checked_at = -math.inf  # when the sentinels last named the primary (monotonic seconds)
        self._check: asyncio.Task[None] | None = None
        self._waited_out: asyncio.Task[None] | None = None  # a check that outlasted CHECK_WAIT_S

    def _start_check(self) -> asyncio.Task[None] | None:
        now = time.monotonic()
        if now >= self._next_check and (self._check is None or self._check.done()):
            self._next_check = now + RECHECK_S
            self._check = asyncio.create_task(self._recheck(), name=f"redis-sentinel:{self.service_name}")
        return self._check

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self._start_check()
        return await super().get_connection(*args, **kwargs)

    async def primary_known(self) -> None:
        """Return at once when the sentinels named the primary within `STALE_S`; else ask them and
        wait for their answer, at most `CHECK_WAIT_S` (then go on: sentinels that do not answer must
        not stop the store)."""
        if time.monotonic() - self._checked_at <= STALE_S:
            return
        check = self._start_check()
        if check is None or check.done() or check is self._waited_out:
            return  # a sentinel that hangs delays the calls of one CHECK_WAIT_S, not every call after
        await asyncio.wait({check}, timeout=CHECK_WAIT_S)
        if not check.done():
            self._waited_out = check

    async def get_master_address(self) -> Any:
        before = self.master_address
        address = await super().get_master_address()
        if before is not None and tuple(before) != tuple(address):
            log.warning("redis primary of %s moved from %s:%s to %s:%s", self.service_name, *before, *address)
        return address

    async def _recheck(self) -> None:
        try:
            address = await self.get_master_address()  # drops idle connections when the primary moved
        except (RedisError, OSError) as exc:
            log.debug("sentinels did not name the primary of %s: %s", self.service_name, exc)
            return
        self._checked_at = time.monotonic()
        for connection in list(self._available_connections):
            if connection.is_connected and (connection.host, connection.port) != tuple(address):
                await connection.disconnect()  # was in use when the primary moved: now idle, drop it

    async def aclose(self) -> None:
        if self._check is not None:
            self._check.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._check
        await super().aclose()


class _SentinelPrimary(aioredis.Redis):
    """The primary's client; closing it also closes the clients of the sentinels it asks."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool = self.connection_pool
        try:
            await super().aclose(close_connection_pool)
        finally:  # the sentinels' clients too when a primary connection's close timed out
            if isinstance(pool, SentinelConnectionPool):
                await pool.sentinel_manager.aclose()


def redis_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """A redis-py asyncio client for `url` (no I/O yet). `kwargs` are redis-py connection options
    (`socket_timeout`, `socket_connect_timeout` in seconds, `retry`, `max_connections`, ...); with a
    `redis+sentinel://` URL they apply to the primary's connections, and the socket timeouts also to
    the sentinels'; with `redis+cluster://` to every node's (gateway/redis_cluster.py). Raises ValueError
    for a malformed sentinel or cluster URL."""
    if is_cluster_url(url):
        return cluster_from_url(url, **kwargs)  # type: ignore[return-value]  # same command interface
    if not is_sentinel_url(url):
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("redis", "rediss"):
            kwargs.setdefault("connection_class",
                              _DemotionAwareSSLConnection if scheme == "rediss" else _DemotionAwareConnection)
        return aioredis.Redis.from_pool(_LeanPool.from_url(url, **kwargs))
    target = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel_kwargs["retry"] = Retry(NoBackoff(), 0)  # a dead sentinel: ask the next one now, not after back-offs
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    return manager.master_for(target.service_name, redis_class=_SentinelPrimary,
                              connection_pool_class=_WatchedSentinelPool, connection_class=_SentinelConnection,
                              db=target.db,
                              username=target.username, password=target.password, **kwargs)


async def primary_known(client: aioredis.Redis) -> None:
    """Before a store's call (outside its Redis budget): with Sentinel, when the pool has not heard
    from the sentinels for `STALE_S` (quiet since), ask them where the primary is, waiting at most
    `CHECK_WAIT_S`, and drop idle connections to any other server. Without it the first commands
    after a quiet spell took the idle connections to a primary the sentinels had replaced (still
    writable until they demote it): counts written there are lost at the demotion, and a burst of
    one key passed its limit on two servers (issue 26 §9). A no-op for other clients (a Redis Cluster
    client has no single pool)."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, _WatchedSentinelPool):
        await pool.primary_known()


async def close_redis(client: aioredis.Redis, store: str) -> None:
    """Close a store's Redis `client` at shutdown without raising. redis-py starts closing every socket
    and then waits for the closes under its `socket_connect_timeout` (0.25-0.5 s for the stores);
    when that wait runs out (an event loop busy at shutdown, a Redis gone) it raises a TimeoutError
    although the sockets are closing anyway, and that would skip the rest of the gateway's shutdown.
    Logged at warning level instead, naming `store`. The wait is bounded by `CLOSE_WAIT_S` here (the
stores' `socket_connect_timeout` is the long `SOCKET_BACKSTOP_S`)."""
    try:
        async with asyncio.timeout(CLOSE_WAIT_S):
            await client.aclose()
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("closing the %s store's Redis client: %s: %s", store, type(exc).__name__, exc)
