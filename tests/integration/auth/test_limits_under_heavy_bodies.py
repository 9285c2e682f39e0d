"""Per-key limits hold while another client sends CPU-heavy bodies (issue 15 §1, §4): a real gateway
on a loopback port, limits in the real Redis (own key prefix), the simulator as the engine.

Before the fix, 49,999 tiny `data:` PNG parts held the event loop for seconds: every Redis check in
flight timed out, the limiter's breaker opened, and with `fail_mode: open` the attacker's own key
went unlimited, with `closed` an idle, well-behaved key got 503s. The heavy bodies themselves were
refused (400) before any limit was counted, so they cost their sender nothing, and a key over its
limit still made the gateway fetch its image URLs.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.auth.keys import hash_key
from gateway.serving.server import ThreadedServer
from tests.integration.auth.conftest import REDIS_URL, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
MALLORY_KEY = "sk-mallory-" + "m" * 40
VICTIM_KEY = "sk-victim-" + "v" * 40
MALLORY_RPM = 8
HI = [{"role": "user", "content": "Hi"}]


def png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


TINY = "data:image/png;base64," + base64.b64encode(png(1, 1)).decode()


def heavy_bodies() -> dict[str, dict[str, Any]]:
    """Bodies of the issue's shapes, each too long for the 131,072-token pool."""
    return {
        "images": {"model": "kimi-k3", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": TINY}}] * 49_999}]},
        "parts": {"model": "kimi-k3", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "word " * 20}] * 49_999}]},
        "ids": {"model": "kimi-k3", "max_tokens": 5, "prompt": [1000] * 1_500_000},
    }


def limited_gateway(start_gateway: StartGateway, sim: RunningSim, key_prefix: str, fail_mode: str,
                    **settings: Any) -> RunningGateway:
    # A check's budget of 1 s, not the 50 ms default: the heavy bodies keep both cores busy (parse
    # processes) while the suite's other workers run too, and a Redis answer that waits for a CPU is not
    # what this is about (at 0.25 s, a loaded run saw the victim's checks time out); stalls of the event
    # loop for seconds (the bug) still outlast it.
    auth = {"enabled": True, "fail_mode": fail_mode, "key_prefix": key_prefix, "redis_timeout": 1.0, "keys": [
        {"name": "mallory", "sha256": hash_key(MALLORY_KEY), "requests_per_minute": MALLORY_RPM},
        {"name": "victim", "sha256": hash_key(VICTIM_KEY), "requests_per_minute": 10_000},
    ]}
    return start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth, redis_url=REDIS_URL,
                         affinity={"enabled": False}, load={"enabled": False}, **settings)


def encoded(body: dict[str, Any]) -> tuple[str, bytes]:
    """`(path, JSON bytes)` of a body, to encode a heavy one once: re-encoding its ~5-8 MB on every
    send held the GIL of the process the gateway runs in for ~0.1 s at a time, stalling the gateway's
    event loop (its Redis checks timed out) as no remote client can."""
    return ("/completions" if "prompt" in body else "/chat/completions"), json.dumps(body).encode()


def send(client: httpx.Client, gw: RunningGateway, key: str, request: tuple[str, bytes]) -> httpx.Response:
    path, content = request
    return client.post(gw.v1 + path, content=content,
                       headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


def post(client: httpx.Client, gw: RunningGateway, key: str, body: dict[str, Any]) -> httpx.Response:
    return send(client, gw, key, encoded(body))


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
def test_limits_hold_while_another_client_sends_heavy_bodies(start_sim: StartSim, start_gateway: StartGateway,
                                                             key_prefix: str, fail_mode: str) -> None:
    sim = start_sim("vllm")
    gw = limited_gateway(start_gateway, sim, key_prefix, fail_mode)
    bodies = {name: encoded(body) for name, body in heavy_bodies().items()}
    start_a_window_now(gw)  # the counts below stay in one window
    stop = threading.Event()
    mallory: Counter[int] = Counter()
    lock = threading.Lock()

    def attack(names: list[str]) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                for name in names:
                    status = send(client, gw, MALLORY_KEY, bodies[name]).status_code
                    with lock:
                        mallory[status] += 1

    cheap = {"model": "kimi-k3", "messages": HI, "max_tokens": 2}
    bodies["cheap"] = encoded(cheap)
    attackers = [threading.Thread(target=attack, args=(names,), daemon=True)
                 for names in (["images", "cheap"], ["parts", "ids", "cheap"], ["cheap"])]
    for thread in attackers:
        thread.start()
    victim: Counter[int] = Counter()
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline or sum(mallory.values()) < 3 * MALLORY_RPM:
                assert time.monotonic() < deadline + 30, f"the attack made no progress: {mallory}"
                victim[post(client, gw, VICTIM_KEY, cheap).status_code] += 1
    finally:
        stop.set()
        for thread in attackers:
            thread.join(60)
    # Every request of the attacker's counted, heavy or not: at most its limit got past the limiter
    # (answered 200, or 400 for a heavy body), the rest was refused by it (429).
    assert mallory[200] + mallory[400] <= MALLORY_RPM, mallory
    assert set(mallory) <= {200, 400, 429}, mallory
    assert mallory[429] >= 2 * MALLORY_RPM, mallory
    # The well-behaved key was served throughout: no 503 from a breaker opened by the gateway's own stalls.
    assert set(victim) == {200}, victim
    assert gw.metric('kimi_gateway_redis_errors_total{op="rate_limit"}') == 0
    assert gw.metric('kimi_gateway_rate_limit_unavailable_total') == 0


class ImageHits:
    """A loopback image server that counts the requests it gets."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

        async def image(request: Request) -> Response:
            with self._lock:
                self.count += 1
            return Response(png(640, 480), media_type="image/png")

        self.server = ThreadedServer(Starlette(routes=[Route("/img/{n}", image)])).start()


def test_a_key_over_its_limit_fetches_no_image_url(start_sim: StartSim, start_gateway: StartGateway,
                                                   key_prefix: str) -> None:
    images = ImageHits()
    try:
        sim = start_sim("vllm")
        gw = limited_gateway(start_gateway, sim, key_prefix, "closed",
                             image_fetch={"enabled": True, "allow_networks": ["127.0.0.1/32"]})
        start_a_window_now(gw)
        with httpx.Client(timeout=30) as client:
            def with_images(first: int) -> dict[str, Any]:
                parts = [{"type": "image_url", "image_url": {"url": f"{images.server.url}/img/{first + i}"}}
                         for i in range(4)]
                return {"model": "kimi-k3", "max_tokens": 2,
                        "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, *parts]}]}

            answers = [post(client, gw, MALLORY_KEY, with_images(10 * i)).status_code for i in range(MALLORY_RPM)]
            assert answers == [200] * MALLORY_RPM
            assert images.count == 4 * MALLORY_RPM  # measured while within the limit
            refused = [post(client, gw, MALLORY_KEY, with_images(1000 + 10 * i)) for i in range(5)]
            assert [r.status_code for r in refused] == [429] * 5
            assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
            assert images.count == 4 * MALLORY_RPM  # no fetch for a refused request
            # An invalid body counts too (it is refused after counting): the key stays refused.
            assert post(client, gw, MALLORY_KEY, {"model": "kimi-k3", "messages": []}).status_code == 429
    finally:
        images.server.stop()
