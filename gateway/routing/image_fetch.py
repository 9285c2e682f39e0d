"""Opt-in measuring of client `http(s)://` image URLs, with SSRF guards (config `image_fetch`).

The engine fetches an image URL itself; the gateway fetches it only to read the pixel size for
the prompt-token estimate, so a large image does not get routed to a pool that is too small.
Per hop: the host is resolved once, every resolved address must pass the `AddressPolicy`, and
the request goes to the first of them by IP, with the name in the `Host` header and as TLS SNI
(httpcore's `sni_hostname` request extension, so the certificate is checked against the name):
a DNS answer that changes between the check and the connection (DNS rebinding) cannot move the
connection. Redirects are followed here, each hop checked again. Only the first bytes are read
(`Range` asked, raw bytes, reading stops once `imagesize` finds the size or `max_bytes` is
reached), under a time limit per image and one per request. No result ever fails a request.

Results (metric `kimi_gateway_image_fetches_total{result}`): `ok`, `refused` (policy or scheme),
`error` (DNS, connection, HTTP status, not an image), `timeout`, `too_large` (no size header in
`max_bytes`), `skipped` (beyond `max_images`). Logs name the host and the reason, never the
URL's path or query (signed URLs carry credentials there).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

import httpx

from gateway.observability.metrics import GatewayMetrics
from gateway.routing.address_policy import AddressPolicy, IPAddress, literal_address
from gateway.routing.params import ImageFetchConfig
from gateway.routing.tokens import image_size

log = logging.getLogger("gateway.image_fetch")

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
"""(host name, port) → its addresses, in the order to try them; raises OSError when it cannot."""

Size = tuple[int, int]

_FIRST_PARSE = 32  # bytes: no format's size header is complete in fewer
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


DNS_THREADS = 4


class SystemResolver:
    """The system resolver (getaddrinfo) in the fetcher's own `threads` threads, never in the event
    loop's shared pool: a lookup cannot be stopped once it runs, and an attacker's name server that
    never answers held libuv's 4 shared threads for ~10 s a name, stalling the engines' connections
    and health probes with them (found by a break-it run). When every thread is busy a lookup fails
    at once (OSError: the image costs the default) instead of queueing.

    `lookup` is `socket.getaddrinfo`'s shape (a test passes a slow stand-in).
    """

    def __init__(self, threads: int = DNS_THREADS, lookup: Callable[..., list[Any]] = socket.getaddrinfo) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="image-dns")
        self._lookup = lookup
        self._free = threads

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of `host`, deduplicated, in the resolver's order. Raises OSError."""
        if self._free <= 0:
            raise OSError("every image DNS thread is busy")
        loop = asyncio.get_running_loop()
        self._free -= 1
        running = self._pool.submit(self._lookup, host, port, 0, socket.SOCK_STREAM)
        # The thread is free again only when the lookup really ends, not when we stop waiting.
        running.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        infos = await asyncio.wrap_future(running)
        return list(dict.fromkeys(ip_address(info[4][0]) for info in infos))

    def _release(self) -> None:
        self._free += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class Probe:
    """The outcome of measuring one URL: `result` (see the module docstring), the size when `ok`
    as (width, height) pixels, and a short detail for logs (no path or query)."""

    result: str
    size: Size | None = None
    detail: str = ""


class _Stop(Exception):
    """Ends a probe early with a result other than `ok`."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


class ImageFetcher:
    """Measures image URLs for the token estimate; one per process, built by AppState.

    Owns its own httpx client (no proxies from the environment, no redirects followed by httpx,
    no keep-alive: each fetch is a fresh connection to a freshly checked address), a
    process-wide bound on fetches in flight, and a bounded cache of measured sizes by URL.
    """

    def __init__(self, config: ImageFetchConfig, metrics: GatewayMetrics, resolve: Resolver | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        """`metrics` counts the fetches (`kimi_gateway_image_fetches`, by result); `resolve` turns a
        host name into addresses (default: a `SystemResolver` of this fetcher's own); `verify` is
        httpx's TLS verification (the system CAs; an SSLContext trusting a private CA for an
        internal image host)."""
        self.config = config
        self.policy = AddressPolicy(config.allow_networks)
        self._metrics = metrics
        self._system = SystemResolver() if resolve is None else None
        self._resolve: Resolver = resolve or self._system  # type: ignore[assignment]
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._cache: OrderedDict[str, tuple[float, Size]] = OrderedDict()
        self.http = httpx.AsyncClient(
            trust_env=False,  # an HTTP(S)_PROXY from the environment would connect by name, not to the checked IP
            follow_redirects=False,
            verify=verify,
            timeout=httpx.Timeout(config.timeout),
            limits=httpx.Limits(max_connections=config.max_in_flight, max_keepalive_connections=0),
            headers={"user-agent": "kimi-gateway-image-probe", "accept": "image/*",
                     "accept-encoding": "identity", "range": f"bytes=0-{config.max_bytes - 1}"},
        )

    async def aclose(self) -> None:
        """Close the client and the resolver's threads (AppState.stop)."""
        await self.http.aclose()
        if self._system is not None:
            self._system.close()

    async def measure(self, urls: Iterable[str]) -> dict[str, Size]:
        """(width, height) pixels of those of `urls` that could be measured, by URL.

        Fetches at most `max_images` distinct URLs (the rest count as `skipped`), `concurrency`
        at a time, all within `request_budget` seconds; never raises for a URL's failure.
        Cancelling the caller (client hung up) cancels the fetches.
        """
        config = self.config
        sizes: dict[str, Size] = {}
        todo = []
        for url in dict.fromkeys(urls):
            cached = self._cached(url)
            if cached is not None:
                sizes[url] = cached
            else:
                todo.append(url)
        if len(todo) > config.max_images:
            self._metrics.image_fetched("skipped", len(todo) - config.max_images)
            todo = todo[:config.max_images]
        if not todo:
            return sizes
        turns = asyncio.Semaphore(config.concurrency)
        done: set[str] = set()

        async def one(url: str) -> None:
            async with turns, self._slots:
                probe = await self.probe(url)
            done.add(url)
            self._note(url, probe)
            if probe.size is not None:
                sizes[url] = probe.size
                self._remember(url, probe.size)

        try:
            async with asyncio.timeout(config.request_budget), asyncio.TaskGroup() as group:
                for url in todo:
                    group.create_task(one(url))
        except TimeoutError:
            late = [url for url in todo if url not in done]
            self._metrics.image_fetched("timeout", len(late))
            log.info("image fetch: %d of %d images not measured within the %.1fs request budget",
                     len(late), len(todo), config.request_budget)
        return sizes

    async def probe(self, url: str) -> Probe:
        """Measure one URL within `timeout` seconds; a Probe for every outcome (raises only CancelledError)."""
        try:
            async with asyncio.timeout(self.config.timeout):
                return await self._follow(httpx.URL(url))
        except _Stop as stop:
            return Probe(stop.result, detail=stop.detail)
        except (TimeoutError, httpx.TimeoutException):
            return Probe("timeout", detail=f"no size within {self.config.timeout:g}s")
        except Exception as exc:  # any failure of a measurement falls back to the default cost
            return Probe("error", detail=type(exc).__name__)

    async def _follow(self, url: httpx.URL) -> Probe:
        """GET `url` pinned to a checked address, following up to `max_redirects` redirects."""
        for _ in range(self.config.max_redirects + 1):
            request = await self._pinned_request(url)
            response = await self.http.send(request, stream=True)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = url.join(response.headers["location"])
                    continue
                return await self._read_size(response)
            finally:
                await response.aclose()
        raise _Stop("error", f"more than {self.config.max_redirects} redirects")

    async def _pinned_request(self, url: httpx.URL) -> httpx.Request:
        """A GET of `url` addressed to a resolved, checked IP; _Stop("refused") when policy says no."""
        if url.scheme not in self.config.allowed_schemes:
            raise _Stop("refused", f"scheme {url.scheme!r} is not allowed")
        name = url.raw_host.decode("ascii")
        if not name:
            raise _Stop("error", "no host")
        literal = literal_address(name)
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = [literal] if literal is not None else await self._resolve(name, port)
        if not addresses:
            raise _Stop("error", f"{name} has no address")
        for address in addresses:  # all of them: a name that also points inside is refused
            if (reason := self.policy.refusal(address)) is not None:
                raise _Stop("refused", f"{name} -> {address} is {reason}")
        extensions = {"sni_hostname": name} if url.scheme == "https" and literal is None else {}
        return self.http.build_request("GET", url.copy_with(host=str(addresses[0])),
                                       headers={"host": url.netloc.decode("ascii")}, extensions=extensions)

    async def _read_size(self, response: httpx.Response) -> Probe:
        """Read the body's first bytes until `imagesize` finds the size or `max_bytes` is reached."""
        if response.status_code not in (200, 206):
            raise _Stop("error", f"HTTP {response.status_code}")
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            raise _Stop("error", "encoded body")  # decoding would be needed first (and could bomb)
        limit = self.config.max_bytes
        head = bytearray()
        next_parse = _FIRST_PARSE
        async for chunk in response.aiter_raw():
            head += chunk
            if len(head) >= next_parse or len(head) >= limit:
                del head[limit:]
                if (size := image_size(bytes(head))) is not None:
                    return Probe("ok", size)
                if len(head) >= limit:
                    raise _Stop("too_large", f"no size header in the first {limit} bytes")
                next_parse = 2 * len(head)  # re-parse on doubling: a trickled body costs O(n log n), not O(n^2)
        if (size := image_size(bytes(head))) is not None:
            return Probe("ok", size)
        raise _Stop("error", "not an image of a known format")

    def _note(self, url: str, probe: Probe) -> None:
        self._metrics.image_fetched(probe.result)
        if probe.result != "ok":
            log.info("image fetch %s from %s: %s", probe.result, _host_of(url), probe.detail)

    def _cached(self, url: str) -> Size | None:
        entry = self._cache.get(url)
        if entry is None:
            return None
        expires, size = entry
        if expires < time.monotonic():
            del self._cache[url]
            return None
        self._cache.move_to_end(url)
        return size

    def _remember(self, url: str, size: Size) -> None:
        if self.config.cache_entries == 0:
            return
        self._cache[url] = (time.monotonic() + self.config.cache_ttl, size)
        self._cache.move_to_end(url)
        while len(self._cache) > self.config.cache_entries:
            self._cache.popitem(last=False)


def _host_of(url: str) -> str:
    """The host of `url` for a log line (never its path or query), "?" when it is no URL."""
    try:
        return httpx.URL(url).host or "?"
    except Exception:  # an invalid URL is logged without its text
        return "?"
