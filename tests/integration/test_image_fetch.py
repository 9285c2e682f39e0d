"""Opt-in image URL fetching (config `image_fetch`): real loopback image servers, the real SDK, the simulator.

The servers serve the shared CC0 test images, redirect, trickle and stream without end. The
gateway measures what its address policy lets it reach and charges the default cost for the rest;
every request is served, and the engine always receives the client's URL unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.observability.metrics import GatewayMetrics
from gateway.routing.address_policy import IPAddress
from gateway.routing.image_fetch import ImageFetcher
from gateway.routing.params import ImageFetchConfig
from gateway.serving.server import ThreadedServer
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

LOOPBACK_ALLOWED = {"enabled": True, "allow_networks": ["127.0.0.1/32"]}
FETCHES = "kimi_gateway_image_fetches_total"
TRICKLE_BYTES = 200  # of a PNG, one byte per 50 ms: its size header (26 bytes) takes 1.3 s
ENDLESS_CHUNK = 16 * 1024
ENDLESS_CHUNKS = 4096  # 64 MiB: "endless" for a reader that stops at max_bytes, bounded for the test


@dataclass
class ImageServer:
    """A loopback HTTP server of the shared images; `hits` are (path, Host, Range) per request."""

    server: ThreadedServer
    hits: list[tuple[str, str, str]] = field(default_factory=list)
    streamed: int = 0
    stream_ended: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port


def image_app(images: Path, handle: ImageServer) -> Starlette:
    """/images/NAME, /redirect?to=URL, /hops/N (N redirects, then an image), /trickle, /endless."""

    def seen(request: Request) -> None:
        handle.hits.append((request.url.path, request.headers.get("host", ""), request.headers.get("range", "")))

    def serve(name: str) -> Response:
        kind = "image/png" if name.endswith(".png") else "image/jpeg"
        return Response((images / name).read_bytes(), media_type=kind)

    async def image(request: Request) -> Response:
        seen(request)
        return serve(request.path_params["name"])

    async def redirect(request: Request) -> Response:
        seen(request)
        return RedirectResponse(request.query_params["to"], status_code=302)

    async def hops(request: Request) -> Response:
        seen(request)
        left = request.path_params["n"]
        return serve("coffee_336.jpg") if left == 0 else RedirectResponse(f"/hops/{left - 1}", status_code=302)

    async def trickle(request: Request) -> Response:
        seen(request)
        data = (images / "camera_man_128.png").read_bytes()[:TRICKLE_BYTES]

        async def body() -> Any:
            try:
                for i in range(len(data)):
                    if await request.is_disconnected():
                        break
                    yield data[i:i + 1]
                    handle.streamed += 1
                    await asyncio.sleep(0.05)
            finally:
                handle.stream_ended.set()

        return StreamingResponse(body(), media_type="image/png")

    async def endless(request: Request) -> Response:
        seen(request)

        async def body() -> Any:
            chunk = bytes(ENDLESS_CHUNK)  # zeros: no format's header, so no size is ever found
            try:
                for _ in range(ENDLESS_CHUNKS):
                    if await request.is_disconnected():  # as a real server notices a closed socket
                        break
                    yield chunk
                    handle.streamed += len(chunk)
            finally:
                handle.stream_ended.set()

        return StreamingResponse(body(), media_type="image/png")

    return Starlette(routes=[
        Route("/images/{name}", image), Route("/redirect", redirect), Route("/hops/{n:int}", hops),
        Route("/trickle", trickle), Route("/endless", endless),
    ])


@pytest.fixture
def start_images(shared_data: Path) -> Iterator[Callable[..., ImageServer]]:
    """Factory: `start_images(host="127.0.0.1", **uvicorn kwargs)` → a running ImageServer."""
    servers: list[ThreadedServer] = []

    def start(host: str = "127.0.0.1", **kwargs: Any) -> ImageServer:
        handle = ImageServer(server=None)  # type: ignore[arg-type]
        handle.server = ThreadedServer(image_app(shared_data / "images", handle), host=host, **kwargs).start()
        servers.append(handle.server)
        return handle

    yield start
    for server in servers:
        server.stop()


def ask(gw: RunningGateway, urls: list[str]) -> tuple[int, str]:
    """One chat request with these image URLs through the real SDK: (estimated tokens, method)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": "What do these pictures show?"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=4, messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    assert raw.parse().choices[0].message.content
    tokens, method = raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split("; method=")
    return int(tokens), method


def sent_urls(sim: RunningSim) -> list[str]:
    """The image URLs the engine received in its last request."""
    parts = sim.engine.records[-1].body["messages"][0]["content"]
    return [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]


def fetches(gw: RunningGateway, result: str) -> float:
    return gw.metric(f'{FETCHES}{{result="{result}"}}')


def test_allowed_images_are_measured_and_forwarded_unchanged(
        start_sim: StartSim, start_gateway: StartGateway, start_images: Callable[..., ImageServer],
        shared_data: Path) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], image_fetch=LOOPBACK_ALLOWED)
    names = ["astronaut_512.jpg", "text_448x172.png", "hubble_deep_field_800.jpg"]
    urls = [f"{images.url}/images/{name}?sig=secret-{i}" for i, name in enumerate(names)]
    tokens, method = ask(gw, urls)
    assert method == "bytes+pixels"
    assert sent_urls(sim) == urls
    assert fetches(gw, "ok") == 3
    # Each fetch asked for the first max_bytes only and named the host it was sent to.
    assert sorted(h[0] for h in images.hits) == sorted(f"/images/{n}" for n in names)
    assert {(h[1], h[2]) for h in images.hits} == {(f"127.0.0.1:{images.port}", "bytes=0-262143")}
    # The same images as data URIs (measured from their bytes) give the same estimate: the fetch
    # read the real size (512x512 -> 361, 448x172 -> 112, 800x698 -> 725 tokens), not the 1,280 default.
    uris = ["data:image/" + ("png" if n.endswith(".png") else "jpeg") + ";base64,"
            + base64.b64encode((shared_data / "images" / n).read_bytes()).decode() for n in names]
    assert ask(gw, uris) == (tokens, "bytes+pixels")
    without_images, _ = ask(gw, [])
    assert tokens - without_images == 361 + 112 + 725
    # A measured size is cached: asking again fetches nothing.
    assert ask(gw, urls) == (tokens, "bytes+pixels")
    assert len(images.hits) == 3


def test_fetch_is_off_by_default(start_sim: StartSim, start_gateway: StartGateway,
                                 start_images: Callable[..., ImageServer]) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    url = f"{images.url}/images/coffee_336.jpg"
    assert ask(gw, [url])[1] == "bytes+default"
    assert images.hits == []
    assert sent_urls(sim) == [url]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "0x7f.1", "017700000001", "127.1"])
def test_loopback_is_refused_by_default_in_every_spelling(
        host: str, start_sim: StartSim, start_gateway: StartGateway,
        start_images: Callable[..., ImageServer]) -> None:
    # `localhost` is a name: refused because of the address it resolves to (127.0.0.1).
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], image_fetch={"enabled": True})
    url = f"http://{host}:{images.port}/images/coffee_336.jpg"
    assert ask(gw, [url])[1] == "bytes+default"
    assert fetches(gw, "refused") == 1
    assert fetches(gw, "ok") == 0
    assert images.hits == []  # not even connected to
    assert sent_urls(sim) == [url]


def test_metadata_private_and_mapped_addresses_are_refused_without_a_connection(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], image_fetch=LOOPBACK_ALLOWED)
    urls = ["http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "http://[fd00:ec2::254]/latest/meta-data/", "http://100.100.100.200/latest/meta-data/",
            "http://10.0.0.1/a.png", "http://[::ffff:169.254.169.254]/", "http://0xa9fea9fe/", "http://[::]:80/",
            "ftp://example.com/a.png", "file:///etc/passwd"]
    assert ask(gw, urls)[1] == "bytes+default"
    assert fetches(gw, "refused") == len(urls)
    assert sent_urls(sim) == urls


def test_redirects_are_checked_at_every_hop(start_sim: StartSim, start_gateway: StartGateway,
                                           start_images: Callable[..., ImageServer]) -> None:
    sim, allowed = start_sim("vllm"), start_images()
    inside = start_images(host="127.0.0.2")  # loopback too, but not in allow_networks
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       image_fetch={**LOOPBACK_ALLOWED, "max_redirects": 3})
    to_inside = f"{allowed.url}/redirect?to={inside.url}/images/coffee_336.jpg"
    to_metadata = f"{allowed.url}/redirect?to=http://169.254.169.254/latest/meta-data/"
    assert ask(gw, [to_inside, to_metadata])[1] == "bytes+default"
    assert fetches(gw, "refused") == 2
    assert inside.hits == []
    assert sorted(h[0] for h in allowed.hits) == ["/redirect", "/redirect"]
    # Redirects between allowed addresses are followed, up to max_redirects.
    assert ask(gw, [f"{allowed.url}/redirect?to=/images/coffee_336.jpg", f"{allowed.url}/hops/3"])[1] == \
        "bytes+pixels"
    assert ask(gw, [f"{allowed.url}/hops/4"])[1] == "bytes+default"
    assert fetches(gw, "ok") == 2
    assert fetches(gw, "error") == 1
    assert sent_urls(sim) == [f"{allowed.url}/hops/4"]


def test_trickling_server_is_cut_by_the_timeout(start_sim: StartSim, start_gateway: StartGateway,
                                               start_images: Callable[..., ImageServer]) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], image_fetch={**LOOPBACK_ALLOWED, "timeout": 0.5})
    assert ask(gw, [f"{images.url}/trickle"])[1] == "bytes+default"
    assert fetches(gw, "timeout") == 1
    # The gateway hung up: the server stops trickling long before its 200 bytes.
    assert images.stream_ended.wait(5)
    assert images.streamed < TRICKLE_BYTES


def test_request_budget_bounds_all_fetches_of_a_request(start_sim: StartSim, start_gateway: StartGateway,
                                                        start_images: Callable[..., ImageServer]) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       image_fetch={**LOOPBACK_ALLOWED, "timeout": 30, "request_budget": 0.5})
    urls = [f"{images.url}/trickle?n={i}" for i in range(3)] + [f"{images.url}/images/coffee_64.jpg"]
    # The image that arrived in time is measured; the trickling ones are cut at the budget.
    assert ask(gw, urls)[1] == "bytes+pixels+default"
    assert fetches(gw, "timeout") == 3
    assert fetches(gw, "ok") == 1


def test_endless_body_is_cut_by_max_bytes(start_sim: StartSim, start_gateway: StartGateway,
                                         start_images: Callable[..., ImageServer]) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       image_fetch={**LOOPBACK_ALLOWED, "max_bytes": 64 * 1024, "timeout": 10})
    assert ask(gw, [f"{images.url}/endless"])[1] == "bytes+default"
    assert fetches(gw, "too_large") == 1
    assert images.hits[0][2] == "bytes=0-65535"
    # The gateway closed the connection: the server stopped far short of its 64 MiB.
    assert images.stream_ended.wait(5)
    assert images.streamed < ENDLESS_CHUNK * ENDLESS_CHUNKS // 4


def test_images_beyond_max_images_are_skipped(start_sim: StartSim, start_gateway: StartGateway,
                                             start_images: Callable[..., ImageServer]) -> None:
    sim, images = start_sim("vllm"), start_images()
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], image_fetch={**LOOPBACK_ALLOWED, "max_images": 2})
    urls = [f"{images.url}/images/coffee_64.jpg?i={i}" for i in range(5)]
    assert ask(gw, urls + urls[:1])[1] == "bytes+pixels+default"  # a repeated URL is fetched once
    assert (fetches(gw, "ok"), fetches(gw, "skipped")) == (2, 3)
    assert len(images.hits) == 2


# The fetcher on its own, with a stand-in DNS: names the system resolver does not know, so a
# success proves the connection went to the address the check saw, never to a second lookup.

class StandInDNS:
    """Answers per name, in turn (the last answer repeats), and counts the lookups."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.lookups.append(host)
        turns = self.answers[host]
        return [ip_address(a) for a in (turns.pop(0) if len(turns) > 1 else turns[0])]


def fetcher(dns: StandInDNS, verify: ssl.SSLContext | bool = True, **config: Any) -> ImageFetcher:
    settings = {**LOOPBACK_ALLOWED, **config}
    return ImageFetcher(ImageFetchConfig(**settings), GatewayMetrics(), dns, verify)


@pytest.mark.anyio
async def test_connection_goes_to_the_checked_address_with_the_name_as_host(
        start_images: Callable[..., ImageServer]) -> None:
    images = start_images()
    dns = StandInDNS({"images.test": [["127.0.0.1"]]})
    probe = await fetcher(dns).probe(f"http://images.test:{images.port}/images/coffee_336.jpg")
    assert (probe.result, probe.size) == ("ok", (336, 224))
    assert dns.lookups == ["images.test"]
    assert images.hits[0][:2] == ("/images/coffee_336.jpg", f"images.test:{images.port}")


@pytest.mark.anyio
async def test_rebinding_dns_is_caught_at_the_next_hop(start_images: Callable[..., ImageServer]) -> None:
    # First answer allowed, the next one the metadata address: the redirect's lookup is checked again.
    images = start_images()
    dns = StandInDNS({"rebind.test": [["127.0.0.1"], ["169.254.169.254"]]})
    probe = await fetcher(dns).probe(f"http://rebind.test:{images.port}/redirect?to=/images/coffee_336.jpg")
    assert probe.result == "refused"
    assert "169.254.169.254 is link_local" in probe.detail
    assert dns.lookups == ["rebind.test", "rebind.test"]
    assert [h[0] for h in images.hits] == ["/redirect"]


@pytest.mark.anyio
async def test_a_name_with_any_refused_address_is_refused(start_images: Callable[..., ImageServer]) -> None:
    images = start_images()
    dns = StandInDNS({"mixed.test": [["127.0.0.1", "10.0.0.7"]]})
    probe = await fetcher(dns).probe(f"http://mixed.test:{images.port}/images/coffee_336.jpg")
    assert probe.result == "refused"
    assert images.hits == []


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for the name `images.test` only (and its key)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=images.test", "-addext", "subjectAltName=DNS:images.test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


@pytest.mark.anyio
async def test_https_to_the_pinned_address_verifies_the_certificate_for_the_name(
        start_images: Callable[..., ImageServer], tls_files: tuple[Path, Path]) -> None:
    key, cert = tls_files
    images = start_images(ssl_keyfile=str(key), ssl_certfile=str(cert))
    trust = ssl.create_default_context(cafile=str(cert))
    dns = StandInDNS({"images.test": [["127.0.0.1"]], "other.test": [["127.0.0.1"]]})
    fetch = fetcher(dns, trust)
    ok = await fetch.probe(f"https://images.test:{images.port}/images/text_448x172.png")
    assert (ok.result, ok.size) == ("ok", (448, 172))
    # Same address, but the certificate is not for these names: verification is by the URL's name.
    assert (await fetch.probe(f"https://other.test:{images.port}/images/text_448x172.png")).result == "error"
    assert (await fetch.probe(f"https://127.0.0.1:{images.port}/images/text_448x172.png")).result == "error"
    assert [h[1] for h in images.hits] == [f"images.test:{images.port}"]
    await fetch.aclose()
