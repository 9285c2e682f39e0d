"""A model a key may not use looks exactly like a model that does not exist (issue 37 §6), through a
real gateway with its limits on the real Redis, in front of two simulated vLLM workers: one serving
the key's model (a large context), one serving a model the key may not use (a small context, no
pooling API). For every way of asking (an alias of the hidden model in any case, a prompt too long
for the hidden model's context, a pooling API its pools do not serve, the Anthropic Messages API,
an image URL the gateway would fetch to measure), inline and in the parse processes, the answer is
the unknown model's in status, body bytes (but for the name sent) and headers, no engine sees the
request and the gateway fetches nothing for it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.serving.server import ThreadedServer
from tests.integration.auth.conftest import ALICE_KEY, REDIS_URL, auth_section
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HIDDEN, HIDDEN_ALIAS, UNKNOWN = "secret-model", "secret-alias", "no-such-model"
SMALL_CONTEXT = 4096
VARYING = {"date", "x-request-id", "request-id", "content-length"}
"""Headers that differ between any two answers (the request ids, the time) or with the name's length."""


@pytest.fixture
def image_hits() -> Iterator[tuple[str, list[str]]]:
    """A loopback image server: its URL and the paths it was asked for."""
    hits: list[str] = []

    async def image(request: Request) -> Response:
        hits.append(request.url.path)
        return Response(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, media_type="image/png")

    server = ThreadedServer(Starlette(routes=[Route("/{name}", image)])).start()
    try:
        yield server.url, hits
    finally:
        server.stop()


def gateway(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str,
            offload: bool) -> tuple[RunningGateway, list[RunningSim]]:
    mine = start_sim("vllm")
    hidden = start_sim("vllm", max_context_tokens=SMALL_CONTEXT, served_model_names=[HIDDEN])
    offloaded = {"parse_offload_bytes": 0, "parse_offload_items": 0} if offload else {}
    gw = start_gateway([pool("big", "vllm", [mine.url], 131072), pool("small", "vllm", [hidden.url], SMALL_CONTEXT)],
                       models=[{"name": "kimi-k3", "pools": ["big"]},
                               {"name": HIDDEN, "aliases": [HIDDEN_ALIAS], "pools": ["small"]}],
                       auth=auth_section({"models": ["kimi-k3"], "requests_per_minute": 1000,
                                          "tokens_per_minute": 10_000_000}, key_prefix=key_prefix),
                       redis_url=REDIS_URL, affinity={"enabled": False}, load={"enabled": False},
                       image_fetch={"enabled": True, "allow_networks": ["127.0.0.1/32"]}, **offloaded)
    return gw, [mine, hidden]


def ask(gw: RunningGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=60,
                      headers={"authorization": f"Bearer {ALICE_KEY}", "anthropic-version": "2023-06-01"})


def shape(answer: httpx.Response, sent: str) -> tuple[int, bytes, dict[str, str]]:
    """The answer with the model name the client sent (and an Anthropic body's request id) masked."""
    body = answer.content.replace(sent.encode(), b"<MODEL>")
    body = re.sub(rb'"request_id":"[^"]*"', b'"request_id":"<ID>"', body)
    assert answer.headers["content-length"] == str(len(answer.content))
    return answer.status_code, body, {k: v for k, v in answer.headers.items() if k not in VARYING}


@pytest.mark.parametrize("offload", [False, True], ids=["inline", "parse-process"])
def test_a_model_the_key_may_not_use_looks_like_none_at_all(
        start_sim: StartSim, start_gateway: StartGateway, key_prefix: str, image_hits: tuple[str, list[str]],
        offload: bool) -> None:
    gw, sims = gateway(start_sim, start_gateway, key_prefix, offload)
    image_url, fetched = image_hits
    too_long = "word " * (3 * SMALL_CONTEXT)  # over the hidden model's context, well within the key's model's
    asks: list[tuple[str, str, Callable[[str], dict[str, Any]]]] = [
        ("chat", "/v1/chat/completions",
         lambda m: {"model": m, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ("too long", "/v1/chat/completions",
         lambda m: {"model": m, "messages": [{"role": "user", "content": too_long}], "max_tokens": 2}),
        ("image", "/v1/chat/completions",
         lambda m: {"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "text", "text": "what is it?"},
             {"type": "image_url", "image_url": {"url": image_url + "/x.png"}}]}]}),
        ("embeddings", "/v1/embeddings", lambda m: {"model": m, "input": too_long}),
        ("rerank", "/v1/rerank", lambda m: {"model": m, "query": "which?", "documents": [too_long, "b"]}),
        ("responses", "/v1/responses", lambda m: {"model": m, "input": too_long, "max_output_tokens": 16}),
        ("completions", "/v1/completions", lambda m: {"model": m, "prompt": too_long, "max_tokens": 2}),
        ("messages", "/v1/messages",
         lambda m: {"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": too_long}]}),
        ("count_tokens", "/v1/messages/count_tokens",
         lambda m: {"model": m, "messages": [{"role": "user", "content": too_long}]}),
    ]
    told: list[tuple[str, str, int, str]] = []  # every answer that differs from the unknown model's
    for what, path, body in asks:
        unknown = shape(ask(gw, path, body(UNKNOWN)), UNKNOWN)
        assert unknown[0] == 404, (what, unknown)
        for hidden in (HIDDEN, HIDDEN_ALIAS, "SECRET-Alias"):
            refused = ask(gw, path, body(hidden))
            if shape(refused, hidden) != unknown or f"`{hidden}`" not in refused.text:  # the name as sent
                told.append((what, hidden, refused.status_code, refused.text[:160]))
    for hidden in (HIDDEN, HIDDEN_ALIAS):  # and the model list's own 404
        listed = httpx.get(f"{gw.v1}/models/{hidden}", headers={"authorization": f"Bearer {ALICE_KEY}"}, timeout=60)
        unknown_listed = httpx.get(f"{gw.v1}/models/{UNKNOWN}", headers={"authorization": f"Bearer {ALICE_KEY}"},
                                   timeout=60)
        if shape(listed, hidden) != shape(unknown_listed, UNKNOWN):
            told.append(("retrieve", hidden, listed.status_code, listed.text[:160]))
    if fetched:  # measured for a request its key may not send: work (and time) an unknown name never costs
        told.append(("image fetched", str(fetched), 0, ""))
    assert told == [], "\n".join(map(str, told))
    assert all(sim.engine.records == [] for sim in sims)
    # the key's own model is served, image and all: the refusals were not the gateway failing
    served = ask(gw, "/v1/chat/completions", asks[2][2]("kimi-k3"))
    assert served.status_code == 200, served.text
    assert fetched == ["/x.png"] and len(sims[0].engine.records) == 1
    # counted as auth refusals (the unknown names are the parser's: not counted there)
    assert gw.metric('kimi_gateway_auth_failures_total{reason="model"}') == 3 * len(asks)
