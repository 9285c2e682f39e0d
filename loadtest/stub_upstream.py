"""A fast fake OpenAI-compatible engine for overhead benchmarks: raw asyncio (uvloop) HTTP/1.1.

    python -m loadtest.stub_upstream --port 9000 [--chunks 32] [--chunk-delay 0] [--procs 1]

It answers without thinking, so that what a router in front of it adds is what a benchmark sees:

- `POST /v1/chat/completions`: `stream: true` → an SSE stream in OpenAI's chat-completion chunk
  shape (https://platform.openai.com/docs/api-reference/chat-streaming): `--chunks` events of one
  token each (the first also carries `role`, the last `finish_reason: "stop"`), then a usage event
  when `stream_options.include_usage` is set, then `data: [DONE]`; chunked transfer encoding, one
  socket write per event. Otherwise one `chat.completion` JSON object (content-length).
  `--chunk-delay` seconds pass before each event (0: none, every write happens at once).
- `GET /v1/models`, `/health`, `/metrics` (vLLM's gauge names `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` with a `model_name` label, as vLLM
  exports them, so routers that scrape load are served) and `/version`. Anything else: 404 as an
  OpenAI error object. SGLang's router asks `/server_info` and `/model_info` for a `model_path`:
  none is given on purpose (with one it tries to download that model's tokenizer).

Keep-alive connections, no pipelining (a client sends the next request after the answer). The
body is parsed with orjson, as an engine must to read `stream`. `--procs N` forks N processes
accepting on one listening socket. Counters of unknown paths are printed on exit (stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httptools
import orjson

MODEL = "kimi-k3"
ID_WIDTH = 16
"""Hex digits of the per-response id (fixed, so chunk sizes can be framed in advance)."""
ID_PLACEHOLDER = b"@" * ID_WIDTH
TOKEN = "tok "
"""The text of every generated token."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every answer looks like. `chunk_delay_s`: seconds before each SSE event (0: none)."""

    chunks: int = 32
    chunk_delay_s: float = 0.0
    served_model: str = MODEL


def _frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk (RFC 9112 §7.1) holding `payload`."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: dict[str, object]) -> bytes:
    # The id is a placeholder here, swapped per response: the template's lengths stay exact.
    return b"data: " + orjson.dumps(obj).replace(b'"ID"', b'"chatcmpl-' + ID_PLACEHOLDER + b'"') + b"\n\n"


class Templates:
    """Pre-rendered answers of one model name (SSE events framed as HTTP chunks)."""

    def __init__(self, model: str, chunks: int) -> None:
        created = int(time.time())
        events: list[bytes] = []
        for i in range(chunks):
            delta: dict[str, object] = {"content": TOKEN}
            if i == 0:
                delta = {"role": "assistant", "content": TOKEN}
            events.append(_event({
                "id": "ID", "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": "stop" if i == chunks - 1 else None}]}))
        self.events = [_frame(e) for e in events]
        self.usage_head = (b'data: {"id":"chatcmpl-' + ID_PLACEHOLDER + b'","object":"chat.completion.chunk",'
                           b'"created":%d,"model":' % created + orjson.dumps(model)
                           + b',"choices":[],"usage":')
        self.done = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.chunks = chunks
        self.model = model
        self.created = created

    def usage_event(self, rid: bytes, prompt_tokens: int) -> bytes:
        usage = orjson.dumps({"prompt_tokens": prompt_tokens, "completion_tokens": self.chunks,
                              "total_tokens": prompt_tokens + self.chunks})
        return _frame(self.usage_head.replace(ID_PLACEHOLDER, rid) + usage + b"}\n\n")

    def completion(self, rid: bytes, prompt_tokens: int) -> bytes:
        return orjson.dumps({
            "id": "chatcmpl-" + rid.decode(), "object": "chat.completion", "created": self.created,
            "model": self.model, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                      "content": TOKEN * self.chunks},
                                              "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": self.chunks,
                      "total_tokens": prompt_tokens + self.chunks}})


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
               b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n")


def _head(status: int, content_type: bytes, length: int, keep_alive: bool) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}.get(status, b"")
    close = b"" if keep_alive else b"connection: close\r\n"
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
        status, reason, content_type, length, close)


def _error(message: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}})


class StubUpstream:
    """The state of one engine process: settings, templates per model name, counters."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._templates: dict[str, Templates] = {}
        self._ids = itertools.count(os.getpid() << 32)
        self.running = 0
        self.unknown_paths: Counter[str] = Counter()

    def templates(self, model: str) -> Templates:
        found = self._templates.get(model)
        if found is None:
            if len(self._templates) > 64:  # bounded: routers send one or two model names
                self._templates.clear()
            found = self._templates[model] = Templates(model, self.settings.chunks)
        return found

    def next_id(self) -> bytes:
        return b"%016x" % (next(self._ids) & 0xFFFF_FFFF_FFFF_FFFF)

    def metrics(self) -> bytes:
        name = self.settings.served_model
        return (f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="{name}"}} '
                f'{self.running}.0\n# TYPE vllm:num_requests_waiting gauge\n'
                f'vllm:num_requests_waiting{{model_name="{name}"}} 0.0\n# TYPE vllm:kv_cache_usage_perc gauge\n'
                f'vllm:kv_cache_usage_perc{{model_name="{name}"}} 0.0\n').encode()

    def models(self) -> bytes:
        return orjson.dumps({"object": "list", "data": [{
            "id": self.settings.served_model, "object": "model", "created": 0, "owned_by": "fake-engine",
            "max_model_len": 1_048_576}]})


class HttpConnection(asyncio.Protocol):
    """One client connection: httptools parses requests, answers are written to the transport."""

    def __init__(self, engine: StubUpstream) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.task: asyncio.Task[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close()
        except httptools.HttpParserError:
            self._reply(400, b"application/json", _error("Malformed HTTP request.", "bad_request"), False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if path == b"/v1/chat/completions":
            if method != b"POST":
                self._reply(405, b"application/json", _error("Use POST.", "method_not_allowed"), keep_alive)
            else:
                self._chat(b"".join(self.body), keep_alive)
        elif path == b"/health":
            self._reply(200, b"text/plain", b"", keep_alive)
        elif path == b"/metrics":
            self._reply(200, b"text/plain; version=0.0.4", self.engine.metrics(), keep_alive)
        elif path == b"/v1/models":
            self._reply(200, b"application/json", self.engine.models(), keep_alive)
        elif path == b"/version":
            self._reply(200, b"application/json", b'{"version":"0.0.0-fake"}', keep_alive)
        else:
            self.engine.unknown_paths[path.decode("latin-1")[:100]] += 1
            self._reply(404, b"application/json", _error(f"Unknown path {path.decode('latin-1')[:100]}.",
                                                         "not_found"), keep_alive)

    # answers
    def _reply(self, status: int, content_type: bytes, body: bytes, keep_alive: bool) -> None:
        if self.transport is None:
            return
        self.transport.write(_head(status, content_type, len(body), keep_alive) + body)
        if not keep_alive:
            self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _chat(self, raw: bytes, keep_alive: bool) -> None:
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except (orjson.JSONDecodeError, ValueError):
            self._reply(400, b"application/json", _error("The body is not a JSON object.", "bad_json"), keep_alive)
            return
        model = body.get("model")
        templates = self.engine.templates(model if isinstance(model, str) else self.engine.settings.served_model)
        rid = self.engine.next_id()
        prompt_tokens = len(raw) // 4  # about 4 bytes a token; only the usage figures show it
        if body.get("stream") is not True:
            self._reply(200, b"application/json", templates.completion(rid, prompt_tokens), keep_alive)
            return
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        if self.engine.settings.chunk_delay_s > 0:
            self.transport.pause_reading()  # type: ignore[union-attr]
            self.task = asyncio.get_running_loop().create_task(
                self._slow_stream(templates, rid, prompt_tokens, usage, keep_alive))
            return
        write = self.transport.write  # type: ignore[union-attr]
        write(STREAM_HEAD + (b"\r\n" if keep_alive else b"connection: close\r\n\r\n"))
        for event in templates.events:
            write(event.replace(ID_PLACEHOLDER, rid, 1))
        if usage:
            write(templates.usage_event(rid, prompt_tokens))
        write(templates.done)
        if not keep_alive:
            self._close()

    async def _slow_stream(self, templates: Templates, rid: bytes, prompt_tokens: int, usage: bool,
                           keep_alive: bool) -> None:
        engine = self.engine
        delay = engine.settings.chunk_delay_s
        engine.running += 1
        try:
            transport = self.transport
            if transport is None:
                return
            transport.write(STREAM_HEAD + (b"\r\n" if keep_alive else b"connection: close\r\n\r\n"))
            for event in templates.events:
                await asyncio.sleep(delay)
                if self.transport is None:
                    return  # the client hung up: abort, as an engine does
                transport.write(event.replace(ID_PLACEHOLDER, rid, 1))
            if usage:
                transport.write(templates.usage_event(rid, prompt_tokens))
            transport.write(templates.done)
            if keep_alive:
                transport.resume_reading()
            else:
                self._close()
        finally:
            engine.running -= 1
            self.task = None


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (SO_REUSEADDR), shared by forked processes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


async def serve(sock: socket.socket, settings: EngineSettings) -> None:
    """Serve on `sock` until SIGTERM/SIGINT (the benchmark's `ProcessGroup` also sends SIGTERM when it dies)."""
    loop = asyncio.get_running_loop()
    engine = StubUpstream(settings)
    server = await loop.create_server(lambda: HttpConnection(engine), sock=sock, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        if engine.unknown_paths:
            print(f"fake engine {os.getpid()}: unknown paths {dict(engine.unknown_paths)}", file=sys.stderr)


def _run(sock: socket.socket, settings: EngineSettings) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a gateway dependency off Windows
        asyncio.run(serve(sock, settings))
    else:
        uvloop.run(serve(sock, settings))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stub_upstream", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=32, help="SSE events of one token per streamed answer")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds before each event")
    parser.add_argument("--procs", type=int, default=1, help="processes accepting on one socket")
    parser.add_argument("--served-model", default=MODEL, help="model name in /v1/models and /metrics")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.procs < 1 or args.chunk_delay < 0:
        raise SystemExit("--chunks and --procs must be >= 1, --chunk-delay >= 0")
    settings = EngineSettings(args.chunks, args.chunk_delay, args.served_model)
    sock = listen_socket(args.host, args.port)
    children = []
    for _ in range(args.procs - 1):
        pid = os.fork()
        if pid == 0:
            _run(sock, settings)
            os._exit(0)
        children.append(pid)
    try:
        _run(sock, settings)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
