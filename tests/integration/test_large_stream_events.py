"""Large SSE events through the real gateway in front of scripted engines on loopback.

Before the first token (issue 37 §11): token-level data an engine returns in its first events (vLLM's
chat `return_token_ids` puts the prompt's `prompt_token_ids` in the role chunk,
`vllm/entrypoints/openai/chat_completion/serving.py`; its completions `echo` with `prompt_logprobs`
puts a record per prompt token in the first text chunk, `vllm/entrypoints/openai/completion/serving.py`)
is relayed byte for byte from the one worker that produced it; one over the relay's bound
(`max_body_bytes`) is refused once, clearly, never repeated on the other workers nor held against
them.

Memory (issue 37 §7): a large event, which the relay holds whole until its end, costs the gateway
about twice its size at the peak (held while it grows, then once as the bytes relayed), never a
copy per step it passes through, nor its parsed objects; a small gzip stream decoding to it no more."""

from __future__ import annotations

import asyncio
import itertools
import tracemalloc
import zlib
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.integration.test_engine_http_framing import ENDLESS_HEAD, Answer, ScriptedEngine
from tests.support import RunningGateway, pool

StartGateway = Callable[..., RunningGateway]
StartEngine = Callable[[Answer], ScriptedEngine]
CHUNK = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"kimi-k3","choices":[{"index":0,'
TEXT = b'{"id":"c","object":"text_completion","created":1,"model":"kimi-k3","choices":[{"index":0,'
PROMPT_IDS = b",".join(b"%d" % (100_000 + i) for i in range(250_000))  # 1.7 MB: a 250K-token prompt's ids


def role_chunk_with_prompt_token_ids() -> bytes:
    """vLLM's first chat chunk with `return_token_ids`: the role chunk (no content) holding the prompt's
    token ids, then a token and the end."""
    return (b"data: " + CHUNK + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":[' + PROMPT_IDS + b"]}\n\n"
            b"data: " + CHUNK + b'"delta":{"content":"hi"},"logprobs":null,"finish_reason":"stop"}]}\n\n'
            b"data: [DONE]\n\n")


def echo_with_prompt_logprobs() -> bytes:
    """vLLM's first completions chunk with `echo` and `prompt_logprobs`: the prompt's text and a
    record per prompt token, then the end."""
    logprobs = b",".join(b'{"%d":{"logprob":-1.25,"rank":1,"decoded_token":"tok"}}' % (100_000 + i)
                         for i in range(40_000))
    return (b"data: " + TEXT + b'"text":"' + b"word " * 40_000 + b'","logprobs":null,"finish_reason":null,'
            b'"prompt_logprobs":[null,' + logprobs + b"]}]}\n\n"
            b"data: " + TEXT + b'"text":"!","logprobs":null,"finish_reason":"length"}]}\n\n'
            b"data: [DONE]\n\n")


@pytest.fixture
def engines() -> Iterator[StartEngine]:
    """Factory: `engines(answer)` → a started `ScriptedEngine`, stopped at the end of the test."""
    started: list[ScriptedEngine] = []

    def start(answer: Answer) -> ScriptedEngine:
        started.append(ScriptedEngine(answer))
        return started[-1]

    yield start
    for engine in started:
        engine.stop()


def streamed(body: bytes, piece: int = 64 * 1024) -> Answer:
    """An engine that streams `body` (chunked) in `piece`-byte writes: a large event reaches the
    gateway over many reads."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(ENDLESS_HEAD)
        for at in range(0, len(body), piece):
            part = body[at:at + piece]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    return answer


def two_workers(start_gateway: StartGateway, engines: StartEngine, answer: Answer,
                **settings: object) -> tuple[RunningGateway, list[ScriptedEngine]]:
    started = [engines(answer), engines(answer)]
    gw = start_gateway([pool("p", "vllm", [e.url for e in started], 131072)], health={"interval": 60},
                       load={"enabled": False}, **settings)
    return gw, started


def workers_unblamed(gw: RunningGateway) -> bool:
    """No failure is held against either worker (passive health)."""
    workers = gw.server.app.state.gateway.registry.pools["p"]
    return all(w.consecutive_failures == 0 and w.last_error is None and w.healthy for w in workers)


@pytest.mark.parametrize(("api", "body"), [("chat/completions", role_chunk_with_prompt_token_ids()),
                                           ("completions", echo_with_prompt_logprobs())],
                         ids=["chat_return_token_ids", "completions_echo_prompt_logprobs"])
def test_a_large_event_before_the_first_token_is_relayed_from_one_worker(
        start_gateway: StartGateway, engines: StartEngine, api: str, body: bytes) -> None:
    """A first event of ~2 MB (over the 1 MiB the gateway holds back to fail over unseen) reaches the
    client exactly as the engine sent it, from the first worker alone: the engine produced output, so
    no other worker repeats the request, and neither is blamed."""
    gw, started = two_workers(start_gateway, engines, streamed(body))
    request = {"model": "kimi-k3", "max_tokens": 1, "stream": True}
    request |= {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True} if api.startswith("chat") \
        else {"prompt": "word " * 8, "echo": True, "prompt_logprobs": 1}
    response = httpx.post(f"{gw.v1}/{api}", json=request, timeout=60)
    assert response.status_code == 200, response.text[:300]
    assert response.content == body
    assert sum(len(e.post_connections) for e in started) == 1
    assert workers_unblamed(gw)


def test_an_event_past_the_limit_before_the_first_token_is_refused_once(start_gateway: StartGateway,
                                                                         engines: StartEngine) -> None:
    """The same first event with `max_body_bytes` below its size: one 502 in OpenAI's shape that
    says why and how to avoid it, `x-should-retry: false` (an SDK would resend the whole prefill),
    the one engine request closed (aborted), no second worker asked, neither blamed."""
    body = role_chunk_with_prompt_token_ids()
    gw, started = two_workers(start_gateway, engines, streamed(body), max_body_bytes=1 << 20)
    response = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "return_token_ids": True}, timeout=60)
    assert response.status_code == 502, response.text[:300]
    assert response.headers["x-should-retry"] == "false"
    error = orjson.loads(response.content)["error"]
    assert error["code"] == "upstream_error" and "before the first token" in error["message"]
    assert "1048576 bytes" in error["message"] and "prompt_logprobs" in error["message"]
    assert sum(len(e.post_connections) for e in started) == 1
    assert any(e.ended.wait(5) for e in started)  # the engine's connection was closed: it aborts the request
    assert workers_unblamed(gw)


def gzip_stream(*parts: bytes) -> bytes:
    encoder = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    return b"".join(encoder.compress(part) for part in parts) + encoder.flush()


EVENT_MIB = 24


@pytest.mark.parametrize("where", ["after_content", "before_content"])
def test_a_large_event_in_a_small_gzip_stream_costs_about_twice_its_size(start_gateway: StartGateway,
                                                                         engines: StartEngine, where: str) -> None:
    """A ~25 KiB gzip stream holding one 24 MiB event (a content event then a long one; or, first,
    a role chunk of 24 MiB of prompt token ids): the client gets every byte, and the gateway's traced
    memory peaks below 2.6 times the event (the relay's held event, then the event relayed)."""
    first = b"data: " + CHUNK + b'"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    if where == "after_content":
        big = b'data: {"x": "' + b"a" * (EVENT_MIB << 20) + b'"}\n\n'
        plain = first + big + b"data: [DONE]\n\n"
    else:
        big = (b"data: " + CHUNK + b'"delta":{"role":"assistant","content":""},"finish_reason":null}],'
               b'"prompt_token_ids":[' + b"7," * (EVENT_MIB << 19) + b"7]}\n\n")
        plain = big + first + b"data: [DONE]\n\n"
    body = gzip_stream(plain)
    del big

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))
        for at in range(0, len(body), 4096):
            writer.write(body[at:at + 4096])
            await writer.drain()

    engine = engines(answer)
    gw = start_gateway([pool("p", "vllm", [engine.url], 131072)], health={"interval": 60}, load={"enabled": False})
    size, tail = 0, b""
    tracemalloc.start()
    try:
        with httpx.stream("POST", gw.v1 + "/chat/completions", timeout=60, json={
                "model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
            for chunk in response.iter_bytes():
                size, tail = size + len(chunk), (tail + chunk)[-64:]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 200 and size == len(plain) and plain.endswith(tail)
    assert peak < 2.6 * (EVENT_MIB << 20), f"peak {peak / 2**20:.1f} MiB traced for a {EVENT_MIB} MiB event"


def test_a_continuation_whose_first_event_is_past_the_limit_ends_the_stream_with_one_error(
        start_gateway: StartGateway, engines: StartEngine) -> None:
    """The first worker streams a token and dies; the continuation on the other worker (migration)
    opens with an event past `max_body_bytes`: the client keeps its token and gets one SSE error
    event (no `[DONE]`), no third attempt anywhere."""
    posts = itertools.count()
    token = b"data: " + CHUNK + b'"delta":{"role":"assistant","content":"hel"},"finish_reason":null}]}\n\n'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if next(posts) == 0:  # the first worker: a token, then the connection drops mid-stream
            writer.write(ENDLESS_HEAD + b"%x\r\n%s\r\n" % (len(token), token))
            await writer.drain()
            writer.transport.abort()
            return
        await streamed(role_chunk_with_prompt_token_ids())(reader, writer, index)

    gw, started = two_workers(start_gateway, engines, answer, max_body_bytes=1 << 20)
    response = httpx.post(gw.v1 + "/chat/completions", json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5,
        "return_token_ids": True}, timeout=60)
    assert response.status_code == 200
    events = [e for e in response.content.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == token and b"[DONE]" not in response.content, response.content[:500]
    assert orjson.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert sum(len(e.post_connections) for e in started) == 2
