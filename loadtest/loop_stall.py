"""Worst event-loop stall per request body shape, at the largest body each shape may have.

    python -m loadtest.loop_stall                   # every shape, 3 runs each (~1-2 min)
    python -m loadtest.loop_stall --shapes ids,text --runs 1
    python -m loadtest.loop_stall --gateway-repo ../main   # the same bodies against another checkout

Processes (loopback only, stopped at the end): one simulated vLLM worker (`gateway.cli sim`,
1,048,576-token context) and the gateway (`gateway.cli serve`: one pool of that worker, the largest
pool's context, default limits: `max_body_bytes` 64 MiB, `max_messages` 20,000,
`max_content_parts` 50,000, `max_prompt_ids` 4M; affinity in-process; auth off).

How the stall is measured: a separate probe process sends `GET /health` to the gateway over one
kept-alive connection with blocking sockets, back to back, and records each round trip. While the
gateway's event loop is held by one request, no `/health` is answered, so the longest round trip
seen while a body shape is sent and answered is that request's worst stall (plus one idle round
trip, reported as `probe p50`). The body is sent from this process; the probe runs in its own
process so that the sender's copying is not measured.

Shapes (each the largest the limits allow; all but `ids` are chat requests):
- `small`: one short message, the noise floor (what a busy machine's scheduling alone costs);
- `text`: one user message whose content is one string filling the body limit;
- `messages`: `max_messages` user messages filling it;
- `parts`: one message of `max_content_parts` text parts filling it;
- `parts-tiny`: `max_content_parts` one-letter text parts (a request that fits and is forwarded);
- `images-same`: `max_content_parts - 1` parts, all the same 1x1 PNG `data:` URI (issue 15's body);
- `images`: `max_content_parts - 1` distinct PNG `data:` URIs filling the body limit;
- `ids`: a completions request of `max_prompt_ids` token ids.

Prints one table (milliseconds): per shape the body size, the answer (status and error code), the
worst stall (median and max over `--runs`), the probe's idle p50 round trip, and the request's own
time. Results also go to `loadtest/results/loop-stall-<timestamp>.md`.
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from loadtest.procs import ManagedProcess, ProcessGroup, child_env, free_port, python_argv

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "kimi-k3"
CONTEXT = 1_048_576
MAX_BODY = 64 * 1024 * 1024
MAX_MESSAGES = 20_000
MAX_PARTS = 50_000
MAX_IDS = 4 * 1024 * 1024
SLACK = 4096  # bytes left under the body limit for the JSON around the filled part


def png(width: int, height: int, extra: bytes = b"") -> bytes:
    """A PNG file's signature, IHDR (its size) and an optional ancillary `tEXt` chunk of `extra`."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    text = chunk(b"tEXt", b"c\x00" + extra) if extra else b""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + text
            + chunk(b"IEND", b""))


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8}


def _text(limit: int) -> tuple[str, dict[str, Any]]:
    return "chat", _chat([{"role": "user", "content": "a" * (limit - SLACK)}])


def _messages(limit: int) -> tuple[str, dict[str, Any]]:
    each = (limit - SLACK) // MAX_MESSAGES - len('{"role":"user","content":""},')
    return "chat", _chat([{"role": "user", "content": "a" * each} for _ in range(MAX_MESSAGES)])


def _parts(limit: int) -> tuple[str, dict[str, Any]]:
    each = (limit - SLACK) // MAX_PARTS - len('{"type":"text","text":""},')
    return "chat", _chat([{"role": "user", "content": [{"type": "text", "text": "a" * each}
                                                       for _ in range(MAX_PARTS)]}])


def _parts_tiny(limit: int) -> tuple[str, dict[str, Any]]:
    return "chat", _chat([{"role": "user", "content": [{"type": "text", "text": "a"} for _ in range(MAX_PARTS)]}])


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _images_same(limit: int) -> tuple[str, dict[str, Any]]:
    url = data_uri(png(1, 1))
    return "chat", _chat([{"role": "user", "content": [_image_part(url) for _ in range(MAX_PARTS - 1)]}])


def _images(limit: int) -> tuple[str, dict[str, Any]]:
    overhead = len(_image_part(data_uri(png(1, 1, b"x" * 8)))) + 60  # JSON around each URI, generously
    base64_budget = (limit - SLACK) // (MAX_PARTS - 1) - overhead
    extra = max(8, base64_budget * 3 // 4 - len(png(1, 1, b"x")) - 8)
    parts = []
    for i in range(MAX_PARTS - 1):
        tag = f"{i:08d}".encode()
        parts.append(_image_part(data_uri(png(1 + i % 64, 1 + i // 64 % 64, tag + b"x" * (extra - len(tag))))))
    return "chat", _chat([{"role": "user", "content": parts}])


def _ids(limit: int) -> tuple[str, dict[str, Any]]:
    return "completions", {"model": MODEL, "prompt": [100_000 + i % 50_000 for i in range(MAX_IDS)], "max_tokens": 8}


def _small(limit: int) -> tuple[str, dict[str, Any]]:
    return "chat", _chat([{"role": "user", "content": "Hello!"}])


SHAPES: dict[str, Callable[[int], tuple[str, dict[str, Any]]]] = {
    "small": _small, "text": _text, "messages": _messages, "parts": _parts, "parts-tiny": _parts_tiny,
    "images-same": _images_same, "images": _images, "ids": _ids,
}


# --- the probe process ------------------------------------------------------------------------------------


def _probe(port: int, control: Connection) -> None:  # pragma: no cover - runs in its own process
    """Send GET /health back to back; between a "start" and a "stop" message from `control`, keep
    the round trips (seconds) and send them back."""
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    sock: socket.socket | None = None

    def round_trip() -> float:
        nonlocal sock
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sock.sendall(request)
        seen = b""
        while b"\r\n\r\n" not in seen or not seen.endswith(b"}"):  # /health answers a small JSON object
            data = sock.recv(65536)
            if not data:
                sock.close()
                sock = None
                break
            seen += data
        return time.perf_counter() - started

    round_trip()
    control.send("ready")
    while True:
        command = control.recv()
        if command == "quit":
            return
        times: list[float] = []
        while not control.poll():
            times.append(round_trip())
        control.recv()  # "stop"
        control.send(times)


@dataclass
class Run:
    """One request of one shape: the answer and what the probe saw meanwhile (seconds)."""

    status: int
    code: str
    worst_stall: float
    probe_p50: float
    request_s: float


def send_one(client: httpx.Client, url: str, body: bytes, control: Connection) -> Run:
    control.send("start")
    time.sleep(0.3)  # the probe's idle round trips, before the request
    started = time.perf_counter()
    response = client.post(url, content=body, headers={"content-type": "application/json"})
    request_s = time.perf_counter() - started
    time.sleep(0.2)
    control.send("stop")
    times: list[float] = control.recv()
    code = ""
    if response.status_code != 200:
        try:
            code = response.json()["error"]["code"] or ""
        except (ValueError, KeyError, TypeError):
            code = "?"
    return Run(response.status_code, code, max(times), statistics.median(times), request_s)


def start(group: ProcessGroup, gateway_repo: Path, log_dir: Path) -> int:
    """Start the simulated worker and the gateway; returns the gateway's port."""
    sim_port, port = free_port(), free_port()
    env = child_env()
    sim = group.spawn("sim", python_argv("gateway.cli", "sim", "--engine", "vllm", "--port", str(sim_port),
                                         "--max-context", str(CONTEXT)), env=env)
    sim.wait_http(f"http://127.0.0.1:{sim_port}/health", 30)
    config = {"pools": [{"name": "largest", "engine": "vllm", "workers": [f"http://127.0.0.1:{sim_port}"],
                         "max_context_tokens": CONTEXT}],
              "load": {"enabled": False}, "log_level": "warning"}
    path = log_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    # `python -m` puts the working directory first on sys.path: run in the checkout that serves.
    gateway = ManagedProcess("gateway", python_argv("gateway.cli", "serve", "-c", str(path), "--port", str(port)),
                             log_dir / "gateway.log", env=child_env({"PYTHONPATH": str(gateway_repo)}),
                             cwd=gateway_repo)
    group.children.append(gateway)
    gateway.start()
    gateway.wait_http(f"http://127.0.0.1:{port}/ready", 60)
    return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.loop_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--runs", type=int, default=3, help="requests per shape (default 3)")
    parser.add_argument("--gateway-repo", type=Path, default=REPO,
                        help="checkout whose `gateway` package serves (default: this one)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes: {unknown}")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = RESULTS_DIR / f"loop-stall-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[str] = []
    with ProcessGroup(log_dir) as group:
        port = start(group, args.gateway_repo.resolve(), log_dir)
        ours, theirs = mp.Pipe()
        probe = mp.get_context("spawn").Process(target=_probe, args=(port, theirs), daemon=True)
        probe.start()
        if not ours.poll(60) or ours.recv() != "ready":
            raise RuntimeError("the /health probe process did not start")
        try:
            header = ("| shape | body MB | answer | worst stall ms (median) | worst stall ms (max) "
                      "| probe p50 ms | request ms |")
            rows += [header, "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
            print("\n".join(rows), flush=True)
            with httpx.Client(timeout=120, trust_env=False) as client:
                for name in shapes:
                    api, obj = SHAPES[name](MAX_BODY)
                    body = orjson.dumps(obj)
                    del obj
                    url = f"http://127.0.0.1:{port}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
                    runs = [send_one(client, url, body, ours) for _ in range(args.runs)]
                    stalls = [r.worst_stall * 1000 for r in runs]
                    answer = f"{runs[-1].status} {runs[-1].code}".strip()
                    row = (f"| {name} | {len(body) / 1e6:.1f} | {answer} | {statistics.median(stalls):.1f} "
                           f"| {max(stalls):.1f} | {statistics.median(r.probe_p50 for r in runs) * 1000:.2f} "
                           f"| {statistics.median(r.request_s for r in runs) * 1000:.0f} |")
                    rows.append(row)
                    print(row, flush=True)
        finally:
            ours.send("quit")
            probe.join(5)
    load = os.getloadavg()
    note = (f"\n{len(shapes)} shapes x {args.runs} runs, gateway from {args.gateway_repo}, "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, Python "
            f"{sys.version.split()[0]}\n")
    print(note)
    (RESULTS_DIR / f"loop-stall-{stamp}.md").write_text("\n".join(rows) + "\n" + note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
