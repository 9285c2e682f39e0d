"""Bounded soak test of the gateway under steady load with injected worker faults.

    python -m loadtest.soak --quick          # 2 minutes, a fault every 16 s (every kind once)
    python -m loadtest.soak                  # 10 minutes, a fault every 60 s

Processes (all on loopback, stopped at the end, also on errors and Ctrl-C): N simulated vLLM
workers in one process (`loadtest.workers`), one more as its own `python -m gateway.cli sim`
process (the one that gets SIGKILLed and restarted on the same port), and the gateway
(`python -m gateway.cli serve -c <generated yaml>`: one pool of all of them, default policy,
health interval 1 s, passive_failures 3, ejection_base 2 s, first-byte timeout 2 s).

This process sends requests at a fixed rate (streaming and not, 1-20 KB prompts, ~5 % of clients
hang up early) and, every `--fault-every` seconds, sets one fault on one worker in turn through
`POST /sim/faults` for `--fault-seconds`, then clears it: a 500 burst, 429 + Retry-After, a hang
before headers, a drop after 3 SSE chunks, a hanging /health, and SIGKILL of the extra worker
(restarted `--restart-after` seconds later). Besides, every `--mid-stream-every` seconds for
`--mid-stream-seconds`, a fraction (`--mid-stream-fraction`) of the in-process workers, in turn,
fail their streams mid-generation, one kind each in turn: a TCP reset, an EOF, a stall (past the
gateway's gap limit `timeouts.read`, 2 s here) or the engine's in-band error event, after 3-8 SSE
events (`reset_after_chunks`, `drop_after_chunks`, `stall_after_chunks`, `error_after_chunks`):
the gateway migrates those streams to another worker (README "Migration").

Every response is classified as the client saw it; a request lost without any error the client
could see (a 200 stream without [DONE] and without an error event, a 200 JSON body that does not
parse, or an answer whose text is not the whole answer the simulator gives for its `max_tokens`:
`gateway.sim.tokens.output_text`) must not happen, and every request sent must end as a whole
answer, an error the client saw, or a hang-up of its own. Streams that carried the gateway's
migration seam (`: x-kimi-gateway-migrated`) are counted, with the gateway's
`kimi_gateway_migrations_total` by outcome. At the end: the gateway's `kimi_gateway_in_flight` and
the engines' requests still running or waiting must be 0.
Results: stdout and `loadtest/results/soak-<ts>.{json,md}` (logs in `soak-<ts>-logs/`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gateway.sim.tokens import output_text
from loadtest.procs import ManagedProcess, ProcessError, ProcessGroup, child_env, free_port, python_argv
from loadtest.report import percentile

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "kimi-k3"
MAX_CONTEXT_TOKENS = 131_072
STARTUP_TIMEOUT_S = 60.0
SETTLE_S = 15.0
"""After the load ends: how long to wait for in-flight gauges to reach 0, seconds."""

FAULTS: list[tuple[str, dict[str, Any] | None]] = [
    ("500_burst", {"fail_status": 500, "fail_count": 20}),
    ("429_retry_after", {"fail_status": 429, "retry_after_s": 2}),
    ("hang_before_headers", {"hang_before_headers": True}),
    ("drop_after_chunks", {"drop_after_chunks": 3}),
    ("hang_health", {"hang_health": True}),
    ("kill9_extra_worker", None),
]
"""Fault kinds in rotation: (name, SimFaults body); None = SIGKILL the extra worker process."""

MID_STREAM = ("reset_after_chunks", "drop_after_chunks", "stall_after_chunks", "error_after_chunks")
"""Mid-stream fault kinds (`gateway/sim/config.py`, `SimFaults`), one per faulted worker in turn:
TCP reset, EOF, stall, in-band error event after N SSE events."""

FAULT_LIMITS = httpx.Limits(max_keepalive_connections=0)
"""The fault tasks' connections are not kept: a fault held as long as the sim's idle keep-alive (5 s,
uvicorn's) would otherwise be cleared on a connection the sim is closing (and the clear lost)."""

SEAM = b": x-kimi-gateway-migrated"
"""The SSE comment the gateway sends where a stream goes on on another worker."""

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
         "whiskey", "xray", "yankee", "zulu", "the", "of", "and", "to", "in", "is", "it", "that"]


@dataclass
class Outcome:
    """What the client saw of one request. `kind`: ok, http_error, sse_error, conn_error,
    client_cancelled, client_timeout, lost (no error visible to the client) or violation
    (an error was visible but the protocol was broken, e.g. [DONE] after an error event)."""

    index: int
    sent_s: float
    stream: bool
    prompt_bytes: int
    cancel_after_s: float | None
    kind: str = "pending"
    detail: str = ""
    status: int | None = None
    latency_s: float | None = None
    worker: str | None = None
    attempts: str | None = None
    migrated: bool = False
    """A stream that carried the gateway's migration seam (`SEAM`)."""


@dataclass
class FaultWindow:
    kind: str
    worker: str
    start_s: float
    end_s: float | None = None
    note: str = ""
    errors: dict[str, int] = field(default_factory=dict)
    requests: int = 0


# --- requests ------------------------------------------------------------------------------------------


def make_prompt(rng: random.Random, size: int) -> str:
    words: list[str] = [f"#{rng.getrandbits(48):x}"]
    total = len(words[0])
    while total < size:
        w = rng.choice(WORDS)
        words.append(w)
        total += len(w) + 1
    return " ".join(words)[:size]


def error_code(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "?")
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return "non-json:" + raw[:60].decode("utf-8", "replace")


async def run_stream(resp: httpx.Response, out: Outcome, max_tokens: int) -> None:
    """Read a chat stream to its end and classify it; a whole answer (`ok`) is `[DONE]` after the
    text the simulator gives for `max_tokens` tokens, without an error event."""
    buffer, done, error, content = b"", False, None, False
    text: list[str] = []
    try:
        async for chunk in resp.aiter_raw():
            buffer += chunk
            while (end := buffer.find(b"\n")) >= 0:
                line, buffer = buffer[:end].rstrip(b"\r"), buffer[end + 1:]
                if line.startswith(SEAM):
                    out.migrated = True
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    if error is not None:
                        out.kind, out.detail = "violation", f"[DONE] after error event {error}"
                        return
                    done = True
                    continue
                try:
                    event = orjson.loads(data)
                except orjson.JSONDecodeError:
                    out.kind, out.detail = "lost", f"bad SSE data {data[:60]!r}"
                    return
                if isinstance(event, dict) and "error" in event:
                    err = event["error"]
                    error = str(err.get("code") or err.get("type")) if isinstance(err, dict) else str(err)[:60]
                elif isinstance(event, dict):
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            content = True
                            text.append(piece)
    except httpx.HTTPError as exc:
        out.kind = "conn_error"
        out.detail = f"mid-stream {type(exc).__name__}" + (f" after error event {error}" if error else "")
        return
    if error is not None:
        out.kind, out.detail = "sse_error", f"SSE error event {error}"
    elif done and content and "".join(text) != output_text(max_tokens):
        out.kind, out.detail = "lost", "stream with [DONE] whose text is not the whole answer"
    elif done and content:
        out.kind = "ok"
    elif done:
        out.kind, out.detail = "lost", "stream with [DONE] but no content"
    else:
        out.kind, out.detail = "lost", "200 stream ended without [DONE] and without an error event"


async def run_plain(resp: httpx.Response, out: Outcome, max_tokens: int) -> None:
    try:
        raw = await resp.aread()
    except httpx.HTTPError as exc:
        out.kind, out.detail = "conn_error", f"body {type(exc).__name__}"
        return
    try:
        body = orjson.loads(raw)
        choice = body["choices"][0]
        ok = isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
        whole = ok and choice["message"]["content"] == output_text(max_tokens)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        ok = whole = False
    if whole:
        out.kind = "ok"
    elif ok:
        out.kind, out.detail = "lost", "200 completion whose text is not the whole answer"
    else:
        out.kind, out.detail = "lost", f"200 body not a complete completion ({len(raw)} bytes)"


async def send(client: httpx.AsyncClient, url: str, body: bytes, out: Outcome, max_tokens: int,
               timeout_s: float) -> None:
    started = time.monotonic()

    async def go() -> None:
        async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
            out.status = resp.status_code
            out.worker = resp.headers.get("x-kimi-gateway-worker")
            out.attempts = resp.headers.get("x-kimi-gateway-attempts")
            if resp.status_code != 200:
                raw = await resp.aread()
                out.kind, out.detail = "http_error", f"HTTP {resp.status_code} {error_code(raw)}"
            elif out.stream:
                await run_stream(resp, out, max_tokens)
            else:
                await run_plain(resp, out, max_tokens)

    limit = timeout_s if out.cancel_after_s is None else out.cancel_after_s
    try:
        await asyncio.wait_for(go(), limit)
    except TimeoutError:
        if out.cancel_after_s is not None:
            out.kind, out.detail = "client_cancelled", "client hung up on purpose"
        else:
            out.kind, out.detail = "client_timeout", f"no complete answer within {timeout_s:g} s"
    except httpx.TimeoutException as exc:
        where = "after headers" if out.status else "before headers"
        out.kind, out.detail = "client_timeout", f"{where} {type(exc).__name__} (client read timeout 30 s)"
    except httpx.HTTPError as exc:
        where = "after headers" if out.status else "before headers"
        out.kind, out.detail = "conn_error", f"{where} {type(exc).__name__}"
    out.latency_s = time.monotonic() - started


# --- processes and faults --------------------------------------------------------------------------------


def gateway_config(port: int, urls: list[str]) -> dict[str, Any]:
    return {
        "host": "127.0.0.1", "port": port, "log_level": "warning",
        "model": {"name": MODEL, "aliases": []},
        "pools": [{"name": "soak", "engine": "vllm", "workers": urls, "max_context_tokens": MAX_CONTEXT_TOKENS,
                   "default_output_tokens": 64}],
        "health": {"interval": 1.0, "passive_failures": 3, "ejection_base": 2.0},
        # `read`: the gap limit once content flows, which a stalled stream runs past (then it migrates)
        "timeouts": {"first_byte_base": 2.0, "first_byte_per_1k_tokens": 0.0, "read": 2.0},
    }


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gateway_env() -> dict[str, str]:
    return {k: v for k, v in child_env().items() if not k.startswith("KIMI_GATEWAY_")}


def rss_kb(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def prom_sum(text: str, name: str) -> float | None:
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


class Soak:
    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.group = ProcessGroup(log_dir)
        self.rng = random.Random(args.seed)
        self.outcomes: list[Outcome] = []
        self.windows: list[FaultWindow] = []
        self.rss: list[tuple[float, int]] = []
        self.worker_urls: list[str] = []
        self.extra_url = ""
        self.extra_argv: list[str] = []
        self.extra: ManagedProcess | None = None
        self.gateway: ManagedProcess | None = None
        self.base = ""
        self.notes: list[str] = []
        self.restarts = 0
        self.owners: dict[str, str] = {}
        """Worker URL -> which fault task holds its `/sim/faults` now ("rotation" or "mid_stream")."""
        self.mid_stream: Counter[str] = Counter()
        """Mid-stream fault windows by kind."""

    # processes
    def start(self) -> None:
        a = self.args
        spec, ports = self.log_dir / "workers-spec.json", self.log_dir / "workers-ports.json"
        sim = {"engine": "vllm", "served_model_names": [MODEL], "max_context_tokens": MAX_CONTEXT_TOKENS,
               "ttft_s": a.ttft, "tpot_s": a.tpot, "keep_records": False}
        spec.write_text(json.dumps({"count": a.workers, "sim": sim}), encoding="utf-8")
        host = self.group.spawn("workers", python_argv("loadtest.workers", "--spec", str(spec),
                                                       "--ports-file", str(ports)), env=child_env())
        host.wait_until(ports.exists, STARTUP_TIMEOUT_S, "listening")
        self.worker_urls = [f"http://127.0.0.1:{p}" for p in json.loads(ports.read_text())["ports"]]
        extra_port = free_port()
        self.extra_url = f"http://127.0.0.1:{extra_port}"
        self.extra_argv = python_argv("gateway.cli", "sim", "--engine", "vllm", "--port", str(extra_port),
                                      "--max-context", str(MAX_CONTEXT_TOKENS), "--ttft", str(a.ttft),
                                      "--tpot", str(a.tpot))
        self.start_extra()
        for url in self.worker_urls:
            host.wait_http(url + "/health", STARTUP_TIMEOUT_S)
        port = free_port()
        path = self.log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(deep_merge(gateway_config(port, [*self.worker_urls, self.extra_url]),
                                                     a.gateway_extra)), encoding="utf-8")
        self.gateway = self.group.spawn("gateway", python_argv("gateway.cli", "serve", "-c", str(path)),
                                        env=gateway_env())
        self.base = f"http://127.0.0.1:{port}"
        self.gateway.wait_http(self.base + "/ready", STARTUP_TIMEOUT_S)

    def start_extra(self) -> None:
        self.extra = self.group.spawn(f"extra-worker-{self.restarts}", self.extra_argv, env=child_env())
        self.extra.wait_http(self.extra_url + "/health", STARTUP_TIMEOUT_S)

    def kill_extra(self) -> None:
        if self.extra is not None and self.extra.pid is not None:
            os.kill(self.extra.pid, signal.SIGKILL)
            self.extra.proc.wait(5.0)  # type: ignore[union-attr]

    # load
    def build(self) -> tuple[bytes, bool, int, int]:
        rng, a = self.rng, self.args
        size = int(1024 * 20 ** rng.random())  # log-uniform 1-20 KB
        stream = rng.random() < a.stream_fraction
        max_tokens = rng.randint(8, a.max_tokens)
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": make_prompt(rng, size)}],
                                "max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return orjson.dumps(body), stream, size, max_tokens

    async def load(self, t0: float, duration: float) -> None:
        a = self.args
        url = self.base + "/v1/chat/completions"
        limits = httpx.Limits(max_connections=a.max_concurrency, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=5.0, read=30.0, write=10.0, pool=10.0)
        slots = asyncio.Semaphore(a.max_concurrency)
        tasks: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            i = 0
            while True:
                due = t0 + i / a.rate
                if due - t0 >= duration:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                body, stream, size, max_tokens = self.build()
                cancel = self.rng.uniform(0.02, 0.6) if self.rng.random() < a.cancel_fraction else None
                out = Outcome(i, time.monotonic() - t0, stream, size, cancel)
                self.outcomes.append(out)
                if slots.locked():
                    out.kind, out.detail = "not_sent", "client concurrency cap"
                    i += 1
                    continue
                await slots.acquire()

                async def one(body: bytes = body, out: Outcome = out, mt: int = max_tokens) -> None:
                    try:
                        await send(client, url, body, out, mt, a.request_timeout)
                    finally:
                        slots.release()

                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=a.request_timeout + 5)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def faults(self, t0: float, duration: float) -> None:
        a = self.args
        k = 0
        async with httpx.AsyncClient(timeout=5.0, trust_env=False, limits=FAULT_LIMITS) as client:
            while True:
                at = (k + 1) * a.fault_every
                kind, body = FAULTS[k % len(FAULTS)]
                hold = a.restart_after if body is None else a.fault_seconds
                if at + min(hold, a.fault_seconds) > duration:
                    return
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                if body is None:
                    window = FaultWindow(kind, self.extra_url, time.monotonic() - t0)
                    self.windows.append(window)
                    print(f"[{window.start_s:6.1f} s] fault {kind} on {self.extra_url}", flush=True)
                    await asyncio.to_thread(self.kill_extra)
                    await asyncio.sleep(max(0.0, t0 + at + hold - time.monotonic()))
                    self.restarts += 1
                    try:
                        await asyncio.to_thread(self.start_extra)
                        window.note = f"restarted on the same port after {hold:g} s"
                    except ProcessError as exc:
                        window.note = f"restart failed: {str(exc).splitlines()[0]}"
                        self.notes.append(window.note)
                else:
                    target = self.worker_urls[(k // len(FAULTS) + k) % len(self.worker_urls)]
                    window = FaultWindow(kind, target, time.monotonic() - t0)
                    self.windows.append(window)
                    print(f"[{window.start_s:6.1f} s] fault {kind} on {target}", flush=True)
                    self.owners[target] = "rotation"  # replaces a mid-stream fault there (POST replaces)
                    try:
                        (await client.post(target + "/sim/faults", json=body)).raise_for_status()
                        await asyncio.sleep(max(0.0, t0 + at + hold - time.monotonic()))
                    finally:
                        self.owners.pop(target, None)
                        (await client.post(target + "/sim/faults", json={})).raise_for_status()
                window.end_s = time.monotonic() - t0
                print(f"[{window.end_s:6.1f} s] cleared {kind}", flush=True)
                k += 1

    async def mid_stream_faults(self, t0: float, duration: float) -> None:
        """Every `--mid-stream-every` s for `--mid-stream-seconds`: `--mid-stream-fraction` of the
        in-process workers (at least one, never all: in turn) fail their streams after 3-8 SSE
        events, one `MID_STREAM` kind each in turn. A worker the rotation of `faults` holds is
        skipped, and one it took over meanwhile is left to it."""
        a = self.args
        if a.mid_stream_fraction <= 0:
            return
        urls = self.worker_urls
        n = min(max(1, round(a.mid_stream_fraction * len(urls))), max(len(urls) - 1, 1))
        k = 0
        async with httpx.AsyncClient(timeout=5.0, trust_env=False, limits=FAULT_LIMITS) as client:
            while True:
                at = a.mid_stream_every * (k + 0.5)  # between the rotation's starts
                if at + a.mid_stream_seconds > duration:
                    return
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                held: list[str] = []
                try:
                    for j in range(n):
                        url = urls[(k * n + j) % len(urls)]
                        if url in self.owners:
                            continue
                        kind = MID_STREAM[(k * n + j) % len(MID_STREAM)]
                        self.owners[url] = "mid_stream"
                        held.append(url)
                        self.mid_stream[kind] += 1
                        (await client.post(url + "/sim/faults", json={kind: self.rng.randint(3, 8)})).raise_for_status()
                    await asyncio.sleep(max(0.0, t0 + at + a.mid_stream_seconds - time.monotonic()))
                finally:
                    for url in held:
                        if self.owners.get(url) == "mid_stream":
                            del self.owners[url]
                            with contextlib.suppress(httpx.HTTPError):
                                await client.post(url + "/sim/faults", json={})
                k += 1

    async def sample_rss(self, t0: float, stop: asyncio.Event) -> None:
        pid = self.gateway.pid if self.gateway else None
        while not stop.is_set():
            value = rss_kb(pid)
            if value is not None:
                self.rss.append((time.monotonic() - t0, value))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def progress(self, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 30.0)
            except TimeoutError:
                kinds = Counter(o.kind for o in self.outcomes)
                print(f"[{time.monotonic() - t0:6.1f} s] sent {len(self.outcomes)}: {dict(kinds)}, "
                      f"gateway RSS {self.rss[-1][1] / 1024 if self.rss else 0:.0f} MB", flush=True)

    async def engines_open(self, client: httpx.AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for url in [*self.worker_urls, self.extra_url]:
            try:
                s = (await client.get(url + "/sim/stats")).json()
                out[url] = {k: s.get(k) for k in ("requests", "completed", "aborted", "errors", "running", "waiting")}
            except (httpx.HTTPError, ValueError) as exc:
                out[url] = {"unavailable": type(exc).__name__}
        return out

    async def migrations(self, client: httpx.AsyncClient) -> dict[str, float]:
        """`kimi_gateway_migrations_total` by outcome (streams continued on another worker after a
        mid-stream failure, README "Migration"); {} when /metrics cannot be read."""
        try:
            text = (await client.get(self.base + "/metrics")).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kimi_gateway_migrations_total{") and 'outcome="' in line:
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    async def in_flight(self, client: httpx.AsyncClient) -> float | None:
        try:
            return prom_sum((await client.get(self.base + "/metrics")).text, "kimi_gateway_in_flight")
        except httpx.HTTPError:
            return None

    async def run(self) -> dict[str, Any]:
        a = self.args
        duration = a.minutes * 60.0
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            for url in [*self.worker_urls, self.extra_url]:
                await client.delete(url + "/sim/stats")
        rss_start = rss_kb(self.gateway.pid if self.gateway else None)
        t0 = time.monotonic()
        stop = asyncio.Event()
        side = [asyncio.create_task(self.sample_rss(t0, stop)), asyncio.create_task(self.progress(t0, stop))]
        fault_tasks = [asyncio.create_task(self.faults(t0, duration)),
                       asyncio.create_task(self.mid_stream_faults(t0, duration))]
        try:
            await self.load(t0, duration)
        finally:
            for task in fault_tasks:
                task.cancel()
            for failed in await asyncio.gather(*fault_tasks, return_exceptions=True):
                if isinstance(failed, Exception):  # a fault task that stopped early: say so in the report
                    self.notes.append(f"a fault task stopped: {type(failed).__name__}: {failed}")
            async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
                for url in self.worker_urls:  # leave no fault behind
                    with contextlib.suppress(httpx.HTTPError):
                        await client.post(url + "/sim/faults", json={})
        load_end = time.monotonic() - t0
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            in_flight_now = await self.in_flight(client)
            engines_now = await self.engines_open(client)
            deadline = time.monotonic() + SETTLE_S
            while True:
                in_flight = await self.in_flight(client)
                engines = await self.engines_open(client)
                open_engine = sum((e.get("running") or 0) + (e.get("waiting") or 0) for e in engines.values())
                if (in_flight == 0 and open_engine == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            migrations = await self.migrations(client)
        stop.set()
        await asyncio.gather(*side, return_exceptions=True)
        rss_end = rss_kb(self.gateway.pid if self.gateway else None)
        return {"load_s": load_end, "rss_start_kb": rss_start, "rss_end_kb": rss_end,
                "rss_peak_kb": max([v for _, v in self.rss] + [rss_start or 0, rss_end or 0]),
                "in_flight_at_load_end": in_flight_now, "in_flight_end": in_flight,
                "engines_at_load_end": engines_now, "engines_end": engines,
                "engine_open_end": open_engine, "migrations": migrations}


# --- report ----------------------------------------------------------------------------------------------


IN_FLIGHT_LEAD_S = 1.0
"""A fault window also counts requests sent this long before it (still in flight when it starts)."""

FAILURE_KINDS = ("http_error", "sse_error", "conn_error", "client_timeout", "violation", "lost")
ACCOUNTED = ("ok", "client_cancelled", "http_error", "sse_error", "conn_error", "client_timeout")
"""How a request may end: a whole answer, its client's own hang-up, or an error its client saw."""


def summarize(soak: Soak, measured: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    outs = soak.outcomes
    kinds = Counter(o.kind for o in outs)
    causes = Counter(f"{o.kind}: {o.detail}" for o in outs if o.kind in FAILURE_KINDS)
    ok_lat = [o.latency_s for o in outs if o.kind == "ok" and o.latency_s is not None]
    ok_stream = [o.latency_s for o in outs if o.kind == "ok" and o.stream and o.latency_s is not None]
    ok_plain = [o.latency_s for o in outs if o.kind == "ok" and not o.stream and o.latency_s is not None]
    grace = soak.args.window_grace
    starts = [w.start_s for w in soak.windows[1:]] + [float("inf")]
    # A window counts requests sent from 1 s before the fault (those in flight when it starts) to
    # `grace` s after it ends (or the next fault's start, whichever is first).
    fault_ranges = [(w.start_s - IN_FLIGHT_LEAD_S, min((w.end_s or measured["load_s"]) + grace,
                                                     nxt - IN_FLIGHT_LEAD_S))
                    for w, nxt in zip(soak.windows, starts, strict=True)]
    for w, (begin, end) in zip(soak.windows, fault_ranges, strict=True):
        inside = [o for o in outs if begin <= o.sent_s < end]
        w.requests = len(inside)
        w.errors = dict(Counter(f"{o.kind}: {o.detail}" for o in inside if o.kind in FAILURE_KINDS))
    outside = [o for o in outs if not any(s <= o.sent_s < e for s, e in fault_ranges)]
    outside_errors = dict(Counter(f"{o.kind}: {o.detail}" for o in outside if o.kind in FAILURE_KINDS))

    def p(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(v, 3)

    sent = [o for o in outs if o.kind != "not_sent"]
    moved = [o for o in outs if o.migrated]
    return {
        **meta,
        "sent": len(sent),
        # Every request sent ended as a whole answer, an error the client saw, or its own hang-up.
        "unaccounted": sum(1 for o in sent if o.kind not in ACCOUNTED),
        "migrated_streams": len(moved),
        "migrated_streams_whole": sum(1 for o in moved if o.kind == "ok"),
        "migrated_streams_by_outcome": dict(Counter(o.kind for o in moved)),
        "mid_stream_windows": dict(soak.mid_stream),
        "not_sent_concurrency_cap": kinds.get("not_sent", 0),
        "ok": kinds.get("ok", 0),
        "client_cancelled": kinds.get("client_cancelled", 0),
        "failed": sum(kinds.get(k, 0) for k in FAILURE_KINDS if k != "lost"),
        "lost_without_visible_error": kinds.get("lost", 0),
        "outcome_kinds": dict(kinds),
        "failures_by_cause": dict(causes.most_common()),
        "latency_ok_s": {"p50": p(ok_lat, 50), "p99": p(ok_lat, 99)},
        "latency_ok_stream_s": {"p50": p(ok_stream, 50), "p99": p(ok_stream, 99)},
        "latency_ok_nonstream_s": {"p50": p(ok_plain, 50), "p99": p(ok_plain, 99)},
        "gateway_rss_mb": {k: None if measured[f"rss_{k}_kb"] is None else round(measured[f"rss_{k}_kb"] / 1024, 1)
                           for k in ("start", "end", "peak")},
        "in_flight_at_load_end": measured["in_flight_at_load_end"],
        "in_flight_end": measured["in_flight_end"],
        "engine_open_end": measured["engine_open_end"],
        "engine_unaccounted_end": sum(
            (e.get("requests") or 0) - (e.get("completed") or 0) - (e.get("aborted") or 0) - (e.get("errors") or 0)
            for e in measured["engines_end"].values()),
        "engines_end": measured["engines_end"],
        "migrations": measured["migrations"],
        "fault_windows": [asdict(w) for w in soak.windows],
        "errors_outside_fault_windows": outside_errors,
        "load_seconds": round(measured["load_s"], 1),
        "notes": soak.notes,
        "lost_examples": [asdict(o) for o in outs if o.kind in ("lost", "violation")][:20],
        "failure_samples": [asdict(o) for o in outs if o.kind in FAILURE_KINDS][:300],
    }


def migrated(counts: dict[str, float]) -> str:
    """The migrations figure of the report: `migrated (no_worker, failed, refused)`."""
    n = {k: int(v) for k, v in counts.items()}
    return f"{n.get('migrated', 0)} ({n.get('no_worker', 0)}, {n.get('failed', 0)}, {n.get('refused', 0)})"


def markdown(r: dict[str, Any]) -> str:
    rss = r["gateway_rss_mb"]
    lines = [
        f"# Soak {r['started']}", "", f"`{r['command']}`", "",
        "| figure | value |", "| --- | ---: |",
        f"| requests sent | {r['sent']:,} |",
        f"| served OK | {r['ok']:,} |",
        f"| client-cancelled (on purpose) | {r['client_cancelled']:,} |",
        f"| failed, error visible to the client | {r['failed']:,} |",
        f"| **lost without a visible error** (must be 0) | **{r['lost_without_visible_error']}** |",
        f"| not sent (client concurrency cap) | {r['not_sent_concurrency_cap']} |",
        f"| p50 / p99 latency of OK requests (s) | {r['latency_ok_s']['p50']} / {r['latency_ok_s']['p99']} |",
        f"| p50 / p99 streaming, non-streaming (s) | {r['latency_ok_stream_s']['p50']} / "
        f"{r['latency_ok_stream_s']['p99']}, {r['latency_ok_nonstream_s']['p50']} / "
        f"{r['latency_ok_nonstream_s']['p99']} |",
        f"| gateway RSS start / end / peak (MB) | {rss['start']} / {rss['end']} / {rss['peak']} |",
        f"| kimi_gateway_in_flight at load end / after settling (must be 0) | {r['in_flight_at_load_end']} / "
        f"{r['in_flight_end']} |",
        f"| engine requests running or waiting at the end (must be 0) | {r['engine_open_end']} |",
        f"| engine requests neither completed, aborted nor errored (/sim/stats; a stream cut by the "
        f"`drop_after_chunks` fault counts here) | {r['engine_unaccounted_end']} |",
        f"| streams continued on another worker after a mid-stream failure (gateway metric: migrated; no "
        f"worker, failed, refused) | {migrated(r['migrations'])} |",
        f"| streams the client saw migrate (the seam comment) / of them a whole answer | "
        f"{r['migrated_streams']:,} / {r['migrated_streams_whole']:,} |",
        f"| **requests sent that did not end as a whole answer, a visible error or their own hang-up** "
        f"(must be 0) | **{r['unaccounted']}** |",
        f"| mid-stream fault windows by kind | "
        f"{', '.join(f'{k} {v}' for k, v in r['mid_stream_windows'].items()) or 'none'} |",
        "", "## Failures by cause (as the client saw them)", "",
    ]
    lines += [f"- {n} x {cause}" for cause, n in r["failures_by_cause"].items()] or ["- none"]
    lines += ["", f"## Fault windows (errors of requests sent from the start to {r['settings']['window grace (s)']} s "
              "after the end, or the next fault's start)", "", "| at (s) | fault | worker | requests | errors | note |",
              "| ---: | --- | --- | ---: | --- | --- |"]
    for w in r["fault_windows"]:
        errs = "; ".join(f"{n} x {c}" for c, n in w["errors"].items()) or "0"
        lines.append(f"| {w['start_s']:.0f}-{(w['end_s'] or 0):.0f} | {w['kind']} | {w['worker']} | "
                     f"{w['requests']} | {errs} | {w['note']} |")
    outside = "; ".join(f"{n} x {c}" for c, n in r["errors_outside_fault_windows"].items()) or "0"
    lines += ["", f"Errors outside fault windows: {outside}", "", "## Settings", ""]
    lines += [f"- {k}: {v}" for k, v in r["settings"].items()]
    if r["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--minutes", type=float, default=10.0, help="load duration")
    add("--quick", action="store_true", help="2 minutes, a fault every 16 s for 12 s (each kind once)")
    add("--workers", type=int, default=4, help="simulated vLLM workers in one process (+1 own process)")
    add("--rate", type=float, default=20.0, help="requests per second")
    add("--stream-fraction", type=float, default=0.5)
    add("--cancel-fraction", type=float, default=0.05, help="clients that hang up early on purpose")
    add("--max-tokens", type=int, default=48, help="max_tokens is uniform in 8..this")
    add("--ttft", type=float, default=0.05)
    add("--tpot", type=float, default=0.01)
    add("--fault-every", type=float, default=60.0, help="seconds between fault starts")
    add("--fault-seconds", type=float, default=15.0, help="how long a fault stays on")
    add("--restart-after", type=float, default=60.0, help="seconds before the killed worker is restarted")
    add("--mid-stream-fraction", type=float, default=0.4,
        help="in-process workers whose streams fail mid-generation in each mid-stream window (0: none)")
    add("--mid-stream-every", type=float, default=8.0, help="seconds between mid-stream fault windows")
    add("--mid-stream-seconds", type=float, default=3.0, help="how long a mid-stream fault window lasts")
    add("--window-grace", type=float, default=5.0, help="errors this long after a fault still count to it")
    add("--request-timeout", type=float, default=60.0, help="client gives up on a request after this")
    add("--max-concurrency", type=int, default=400, help="requests in flight at the client, at most")
    add("--gateway-extra", type=json.loads, default={}, metavar="JSON",
        help='merged into the generated gateway config, e.g. \'{"affinity": {"enabled": false}}\'')
    add("--seed", type=int, default=0)
    add("--results-dir", type=Path, default=RESULTS_DIR)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        defaults = build_parser()
        for key, value in {"minutes": 2.0, "fault_every": 16.0, "fault_seconds": 12.0, "restart_after": 12.0}.items():
            if getattr(args, key) == defaults.get_default(key):
                setattr(args, key, value)
    if args.minutes <= 0 or args.rate <= 0 or args.workers < 1 or args.minutes > 120:
        raise SystemExit("--minutes must be in (0, 120], --rate > 0, --workers >= 1")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = args.results_dir / f"soak-{stamp}-logs"
    meta = {"started": stamp, "command": shlex.join(["python", "-m", "loadtest.soak", *argv]), "settings": {
        "minutes": args.minutes, "workers": f"{args.workers} in one process + 1 own process (killed)",
        "rate (req/s)": args.rate, "stream fraction": args.stream_fraction,
        "cancel fraction": args.cancel_fraction, "prompt bytes": "1,024-20,480 log-uniform",
        "max_tokens": f"8-{args.max_tokens}", "ttft/tpot (s)": f"{args.ttft}/{args.tpot}",
        "fault every (s)": args.fault_every, "fault seconds": args.fault_seconds,
        "restart after (s)": args.restart_after, "window grace (s)": args.window_grace,
        "mid-stream faults": f"{args.mid_stream_fraction:g} of the in-process workers, {args.mid_stream_seconds:g} s "
        f"every {args.mid_stream_every:g} s, after 3-8 SSE events: {', '.join(MID_STREAM)} in turn",
        "request timeout (s)": args.request_timeout, "gateway": "health interval 1 s, passive_failures 3, "
        "ejection_base 2 s, first_byte_base 2 s, first_byte_per_1k_tokens 0, read 2 s, default policy",
        "gateway overrides": args.gateway_extra or "none",
        "logs": str(log_dir)}}
    soak = Soak(args, log_dir)
    try:
        print(f"starting {args.workers}+1 workers and the gateway (logs: {log_dir})", flush=True)
        soak.start()
        print(f"soak: {args.minutes:g} min at {args.rate:g} req/s against {soak.base}", flush=True)
        measured = asyncio.run(soak.run())
    finally:
        soak.group.close()
    result = summarize(soak, measured, meta)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    base = args.results_dir / f"soak-{stamp}"
    Path(f"{base}.json").write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    text = markdown(result)
    Path(f"{base}.md").write_text(text, encoding="utf-8")
    print()
    print(text)
    print(f"written: {base}.md and {base}.json")
    bad = (result["lost_without_visible_error"] or result["unaccounted"] or result["in_flight_end"]
           or result["engine_open_end"] or any(o.kind == "violation" for o in soak.outcomes))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
