"""Prefill/decode (PD) disaggregation roles of the simulator, after SGLang's and vLLM's engines.

A PD pair is two workers: a prefill worker computes the prompt's KV cache, a decode worker
receives it and generates. What goes over the wire between a router and the workers (field names,
shapes, endpoints, with their sources) is defined in `gateway/protocol/pd.py`, which this module
reads; tests/integration/sim/test_sim_pd_peers.py checks it against the routers' own traffic
(sglang-router 0.3.2 and vllm-router 0.1.17 in front of the simulator). sglang-router 0.3.2
re-encodes the body from its typed request, so the workers also see its defaults (chat:
`max_tokens` renamed `max_completion_tokens`, `logprobs: false`, `skip_special_tokens: true` ...);
vllm-router 0.1.17's NIXL prefill leg carries `min_tokens: 1` and an X-Request-Id of the form
`___prefill_addr_{P host:port}___decode_addr_{D host:port}_{uuid hex}`, with
`Authorization: Bearer $OPENAI_API_KEY` (empty when unset).

How the engines behave, as simulated here:

SGLang (`python/sglang/srt/disaggregation/decode.py` / `prefill.py`): the decode worker connects
to the prefill worker's bootstrap server (`bootstrap_host:bootstrap_port`), registers for the room
and waits for the KV. The prefill worker does not compute a request before its decode partner has
bootstrapped (its bootstrap queue), then prefills, sends the KV and answers with the first token.
Failures end the request with HTTP 500 (`prepare_abort(..., status_code=INTERNAL_SERVER_ERROR)`);
the decode side's wording is "Decode transfer failed for request rank=0 with exception
KVTransferError(bootstrap_room=R): Request R timed out after T s in KVPoll.WaitingForInput" after
`SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (300 s; `mooncake/conn.py`, `nixl/conn.py`
`KVReceiver.poll`); the prefill side times out in "KVPoll.Bootstrapping" after
`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` (300 s). Metrics (`srt/metrics/collector.py`): counters
`sglang:num_bootstrap_failed_reqs_total`, `sglang:num_transfer_failed_reqs_total`, histogram
`sglang:kv_transfer_latency_ms`, gauges `sglang:num_decode_transfer_queue_reqs` (decode: waiting
for KV) and `sglang:num_prefill_prealloc_queue_reqs` (prefill: waiting for the decode worker's
bootstrap).

vLLM NixlConnector (`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`): the
prefill worker answers with the KV handle (full blocks only, so a prompt shorter than a block gives
`remote_block_ids: []`) and keeps those blocks until the decode worker read them or
`VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s) passed (`vllm:nixl_num_kv_expired_reqs`). The decode
worker reads the blocks from `remote_host:remote_port` (the NIXL side channel); it loads only the
tokens its own prefix cache lacks. A request without `do_remote_prefill` runs aggregated
(prefilled locally). A read that fails ends the request per `kv_load_failure_policy`: "fail" (the
default since late 2025) finishes it with an error, which vLLM's OpenAI server turns into HTTP 500
"Internal server error" (an SSE error event once streaming); "recompute" prefills locally. Metrics
(`NixlPromMetrics`): histograms `vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred`,
counter `vllm:nixl_num_failed_transfers`.

vLLM MooncakeConnector (`.../v1/mooncake/mooncake_connector.py`, bootstrap server in
`mooncake_utils.py`): the prefill worker holds the finished prefill's blocks under `transfer_id`
and answers with no `kv_transfer_params` (`request_finished` returns None); the decode worker
finds the prefill worker through the bootstrap server and the prefill pushes the blocks the decode
lacks. A failed load follows `kv_load_failure_policy` as with NIXL.

The simulator's side channels (test-only, under `/sim/pd/`): a SGLang decode sim POSTs
`/sim/pd/sglang/rooms/{room}` to `bootstrap_host:bootstrap_port` (a prefill sim's HTTP port, or
its `bootstrap_port` listener) and gets an answer when the KV is ready; a NIXL decode sim POSTs
`/sim/pd/nixl/read` to `remote_host:remote_port`; a Mooncake decode sim POSTs
`/sim/pd/mooncake/pull` to `remote_bootstrap_addr` and gets an answer once the prefill of that
`transfer_id` is done. A Mooncake prefill sim answers `GET /query` as the bootstrap server does.
Error wording not quoted above is the sim's.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.protocol.pd import (
    BOOTSTRAP_HOST,
    BOOTSTRAP_PORT,
    BOOTSTRAP_ROOM,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_TRANSFER_PARAMS,
    REMOTE_BLOCK_IDS,
    REMOTE_BOOTSTRAP_ADDR,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    TRANSFER_ID,
)
from gateway.sim.config import SimConfig
from gateway.sim.kvcache import CacheLease

SGLANG_ROOMS_PATH = "/sim/pd/sglang/rooms/"
NIXL_READ_PATH = "/sim/pd/nixl/read"
MOONCAKE_PULL_PATH = "/sim/pd/mooncake/pull"


class PdFailure(Exception):
    """The KV of a request could not be handed over; `message` is what the engine answers (HTTP
    500); `kind` names the failure ("bootstrap", "transfer", "expired", "unknown_handle")."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind


@dataclass
class PdCounters:
    """Running PD totals of one worker (exposed as the engines' metrics, see `gateway.sim.metrics`)."""

    bootstrap_failed: int = 0
    transfer_failed: int = 0
    kv_expired: int = 0
    transfers: int = 0
    transfer_seconds: float = 0.0
    transferred_tokens: int = 0
    waiting_for_kv: int = 0
    """Decode: requests waiting for their KV (SGLang's transfer queue)."""
    bootstrapping: int = 0
    """SGLang prefill: requests waiting for their decode worker's bootstrap (the bootstrap queue)."""
    held_for_decode: int = 0
    """vLLM NIXL prefill: finished prefills whose blocks wait for their decode worker's read."""


@dataclass(eq=False)
class _Room:
    """One SGLang bootstrap room on a prefill worker."""

    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None


@dataclass(eq=False)
class _Transfer:
    """KV blocks a vLLM Mooncake prefill worker holds under one `transfer_id`."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    leases: list[CacheLease] = field(default_factory=list)
    tokens: int = 0
    failed: str | None = None
    expiry: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Handle:
    """KV blocks a vLLM NIXL prefill worker holds for a decode worker."""

    block_ids: list[int]
    leases: list[CacheLease]
    expiry: asyncio.TimerHandle | None = None


class PdState:
    """The PD side of one simulated worker: rooms / held blocks (prefill), counters (both).

    Rooms and handles live in the sim's event loop (its HTTP handlers); counters are read from
    other threads under a lock. `hold` / `release` pin and unpin prefix-cache blocks through the
    callbacks of the owning `SimWorkerState`.
    """

    def __init__(self, config: SimConfig, hold: Callable[[Any], list[CacheLease]],
                 release: Callable[[list[CacheLease]], None]) -> None:
        self.config = config
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self._hold = hold
        self._release = release
        self._lock = threading.Lock()
        self._counters = PdCounters()
        self._rooms: dict[int, _Room] = {}
        self._handles: dict[str, _Handle] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._block_ids = itertools.count(1)

    def counters(self) -> PdCounters:
        """A copy of the counters."""
        with self._lock:
            return PdCounters(**vars(self._counters))

    def count(self, **deltas: float) -> None:
        """Add to counters (thread-safe)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    @property
    def held_handles(self) -> int:
        """vLLM prefill: requests whose blocks are held now (NIXL handles, Mooncake transfers
        whose prefill is done)."""
        return len(self._handles) + sum(1 for t in self._transfers.values() if t.ready.is_set() and not t.failed)

    @property
    def open_transfers(self) -> int:
        """vLLM Mooncake prefill: transfer ids known now (awaited, held or failed)."""
        return len(self._transfers)

    # --- SGLang, prefill side ----------------------------------------------------------------

    def _room(self, room: int) -> _Room:
        state = self._rooms.get(room)
        if state is None:
            state = self._rooms[room] = _Room()
        return state

    def _forget(self, room: int, state: _Room) -> None:
        if self._rooms.get(room) is state:
            del self._rooms[room]

    async def sglang_wait_bootstrap(self, rooms: list[int]) -> list[_Room]:
        """Prefill: wait until a decode worker claimed every room (`pd_wait_timeout_s`, then
        raise PdFailure "bootstrap"); returns the rooms' states for `sglang_kv_ready` /
        `sglang_abandon`. A room is forgotten here once its decode worker's claim has ended."""
        states = [self._room(room) for room in rooms]
        started = time.monotonic()
        timeout = self.config.pd_wait_timeout_s
        self.count(bootstrapping=1)
        try:
            for room, state in zip(rooms, states, strict=True):
                remaining = max(0.0, timeout - (time.monotonic() - started))
                try:
                    await asyncio.wait_for(state.claimed.wait(), remaining)
                except TimeoutError:
                    elapsed = time.monotonic() - started
                    self.count(bootstrap_failed=1)
                    raise PdFailure(
                        f"Prefill bootstrap failed for request rank=0 bootstrap_room={room} with exception "
                        f"KVTransferError(bootstrap_room={room}): Request {room} timed out after "
                        f"{elapsed:.1f}s in KVPoll.Bootstrapping", "bootstrap") from None
        except BaseException:
            self.sglang_abandon(rooms, states, "prefill request ended without KV")
            raise
        finally:
            self.count(bootstrapping=-1)
        return states

    def sglang_kv_ready(self, states: list[_Room]) -> None:
        """Prefill: the KV of these rooms is computed; their decode workers take it."""
        for state in states:
            state.ready.set()

    def sglang_abandon(self, rooms: list[int], states: list[_Room], reason: str) -> None:
        """Prefill: the request ended without KV (failed or aborted): waiting decode workers fail."""
        for room, state in zip(rooms, states, strict=True):
            if not state.ready.is_set():
                state.failed = reason
                state.ready.set()
            self._forget(room, state)

    @property
    def open_rooms(self) -> int:
        """SGLang prefill: rooms known now (claimed or awaited, not yet handed over)."""
        return len(self._rooms)

    async def sglang_claim(self, room: int, timeout_s: float) -> tuple[int, str | None]:
        """A decode worker's bootstrap for `room`: (200, None) once the KV is ready, (408, None)
        after `timeout_s`, (500, reason) when the prefill failed."""
        state = self._room(room)
        state.claimed.set()
        try:
            await asyncio.wait_for(state.ready.wait(), timeout_s)
        except TimeoutError:
            return 408, None
        finally:
            self._forget(room, state)  # the decode worker got its answer or left
        return (500, state.failed) if state.failed is not None else (200, None)

    # --- vLLM NIXL, prefill side -------------------------------------------------------------

    def nixl_offer(self, request_id: str, keys: Any, prompt_tokens: int, port: int) -> dict[str, Any]:
        """Prefill: hold the full blocks of a finished prefill and return the `kv_transfer_params`
        of the answer (see the module docstring)."""
        n_blocks = prompt_tokens // self.config.kv_block_tokens
        block_ids = [next(self._block_ids) for _ in range(n_blocks)]
        if n_blocks:
            handle = _Handle(block_ids, self._hold(keys))
            self._handles[request_id] = handle
            handle.expiry = asyncio.get_running_loop().call_later(
                self.config.kv_hold_timeout_s, self._expire, request_id)
            self.count(held_for_decode=1)
        return {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, REMOTE_BLOCK_IDS: block_ids,
                REMOTE_ENGINE_ID: self.engine_id, REMOTE_REQUEST_ID: request_id,
                REMOTE_HOST: self.config.side_channel_host, REMOTE_PORT: port, "tp_size": 1}

    def _expire(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._release(handle.leases)
            self.count(kv_expired=1, held_for_decode=-1)

    def nixl_read(self, engine_id: Any, request_id: Any, block_ids: Any) -> bool:
        """A decode worker reads held blocks: True (and the blocks are freed) when this worker
        holds exactly them for that request, else False."""
        if engine_id != self.engine_id or not isinstance(request_id, str):
            return False
        handle = self._handles.get(request_id)
        if handle is None or block_ids != handle.block_ids:
            return False
        del self._handles[request_id]
        if handle.expiry is not None:
            handle.expiry.cancel()
        self._release(handle.leases)
        self.count(held_for_decode=-1)
        return True

    # --- vLLM Mooncake, prefill side ---------------------------------------------------------

    def mooncake_query(self, host: str, port: int) -> dict[str, Any]:
        """The bootstrap server's `GET /query` answer: this worker as DP rank 0."""
        return {"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": f"{host}:{port}"}}}}

    def _transfer(self, transfer_id: str) -> _Transfer:
        state = self._transfers.get(transfer_id)
        if state is None:
            state = self._transfers[transfer_id] = _Transfer()
        return state

    def mooncake_offer(self, transfer_id: str, keys: Any, prompt_tokens: int) -> None:
        """Prefill: hold the blocks of a finished prefill under `transfer_id` until the decode
        worker takes them (or `kv_hold_timeout_s` passes)."""
        state = self._transfer(transfer_id)
        if state.ready.is_set():
            return
        state.leases, state.tokens = self._hold(keys), prompt_tokens
        state.ready.set()  # a waiting decode worker takes it (and cancels the expiry) in its turn
        state.expiry = asyncio.get_running_loop().call_later(
            self.config.kv_hold_timeout_s, self._expire_transfer, transfer_id, state)
        self.count(held_for_decode=1)

    def mooncake_abandon(self, transfer_id: str, reason: str) -> None:
        """Prefill: the request ended without KV; a waiting decode worker fails."""
        state = self._transfers.get(transfer_id)
        if state is not None and not state.ready.is_set():
            state.failed = reason
            state.ready.set()
            # A decode worker that comes later still learns of the failure; then it is forgotten.
            asyncio.get_running_loop().call_later(self.config.kv_hold_timeout_s, self._forget_transfer,
                                                  transfer_id, state)

    def _forget_transfer(self, transfer_id: str, state: _Transfer) -> None:
        if self._transfers.get(transfer_id) is state:
            del self._transfers[transfer_id]

    def _expire_transfer(self, transfer_id: str, state: _Transfer) -> None:
        if self._transfers.get(transfer_id) is state:
            del self._transfers[transfer_id]
            self._release(state.leases)
            self.count(kv_expired=1, held_for_decode=-1)

    async def mooncake_pull(self, transfer_id: str, engine_id: Any, timeout_s: float) -> tuple[int, int]:
        """A decode worker takes the blocks of `transfer_id`: (200, prompt tokens) once the
        prefill is done, (404, 0) for another engine id, (408, 0) after `timeout_s`, (500, 0) when
        the prefill failed. The blocks are freed either way."""
        if engine_id != self.engine_id:
            return 404, 0
        state = self._transfer(transfer_id)
        try:
            await asyncio.wait_for(state.ready.wait(), timeout_s)
        except TimeoutError:
            return 408, 0
        finally:
            if self._transfers.get(transfer_id) is state and (state.ready.is_set() or not state.leases):
                del self._transfers[transfer_id]
                if state.expiry is not None:
                    state.expiry.cancel()
                    self.count(held_for_decode=-1)
                self._release(state.leases)
        return (500, 0) if state.failed is not None else (200, state.tokens)

    def close(self) -> None:
        """Free every held block (the server stops)."""
        for request_id in list(self._handles):
            handle = self._handles.pop(request_id)
            if handle.expiry is not None:
                handle.expiry.cancel()
            self._release(handle.leases)
        for transfer_id in list(self._transfers):
            state = self._transfers.pop(transfer_id)
            if state.expiry is not None:
                state.expiry.cancel()
            self._release(state.leases)


# --- decode side: fetch the KV from the prefill worker -------------------------------------------


def as_list(value: Any, n: int) -> list[Any]:
    """A bootstrap field as one entry per prompt (batched requests carry lists)."""
    return list(value) if isinstance(value, list) else [value] * n


def sglang_bootstrap(body: dict[str, Any], n_prompts: int) -> list[tuple[str, int, int]] | str:
    """(host, port, room) per prompt of a SGLang decode request, or the sim's error message when
    the fields are missing or malformed."""
    try:
        hosts = as_list(body[BOOTSTRAP_HOST], n_prompts)
        ports = as_list(body[BOOTSTRAP_PORT], n_prompts)
        rooms = as_list(body[BOOTSTRAP_ROOM], n_prompts)
    except KeyError as exc:
        return f"Disaggregated request is missing {exc.args[0]}"
    if not (len(hosts) == len(ports) == len(rooms) == n_prompts):
        return "bootstrap_host, bootstrap_port and bootstrap_room must have one entry per prompt"
    out = []
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int) or room < 0:
            return "bootstrap_host must be a string, bootstrap_port an integer, bootstrap_room a non-negative integer"
        out.append((host, port, room))
    return out


async def sglang_receive(targets: list[tuple[str, int, int]], timeout_s: float,
                         client: Callable[[], httpx.AsyncClient]) -> None:
    """Decode: bootstrap with each prompt's prefill worker and wait for its KV (all prompts at
    once, as SGLang schedules them as separate requests); raises PdFailure with SGLang's wording
    (see the module docstring)."""
    started = time.monotonic()
    results = await asyncio.gather(*(_sglang_receive_one(host, port, room, timeout_s, started, client)
                                     for host, port, room in targets), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _sglang_receive_one(host: str, port: int, room: int, timeout_s: float, started: float,
                              client: Callable[[], httpx.AsyncClient]) -> None:
    prefix = f"Decode transfer failed for request rank=0 with exception KVTransferError(bootstrap_room={room}): "
    try:
        response = await client().post(f"http://{host}:{port}{SGLANG_ROOMS_PATH}{room}",
                                       json={"timeout_s": timeout_s}, timeout=timeout_s + 5.0)
    except httpx.HTTPError as exc:
        raise PdFailure(f"{prefix}Could not fetch prefill parallel info from bootstrap_addr: {host}:{port} "
                        f"({type(exc).__name__})", "bootstrap") from None
    if response.status_code == 408:
        elapsed = time.monotonic() - started
        raise PdFailure(f"{prefix}Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput",
                        "transfer")
    if response.status_code != 200:
        raise PdFailure(f"{prefix}Failed to get kvcache from prefill instance, it might be dead", "transfer")


def nixl_remote(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a vLLM decode request that asks for a remote prefill, else
    None (the request then runs aggregated)."""
    params = body.get(KV_TRANSFER_PARAMS)
    if isinstance(params, dict) and params.get(DO_REMOTE_PREFILL) is True:
        return params
    return None


async def nixl_pull(params: dict[str, Any], client: Callable[[], httpx.AsyncClient]) -> int:
    """Decode: read the blocks named by `params` from the prefill worker; returns how many blocks
    came over. Raises PdFailure when the handle is unknown there or the side channel is down."""
    block_ids = params.get(REMOTE_BLOCK_IDS) or []
    if not block_ids:
        return 0  # a prompt shorter than one block: nothing to pull (vLLM prefills it locally)
    url = f"http://{params.get(REMOTE_HOST)}:{params.get(REMOTE_PORT)}{NIXL_READ_PATH}"
    try:
        response = await client().post(url, json={
            REMOTE_ENGINE_ID: params.get(REMOTE_ENGINE_ID),
            REMOTE_REQUEST_ID: params.get(REMOTE_REQUEST_ID),
            REMOTE_BLOCK_IDS: block_ids}, timeout=30.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise PdFailure(f"NIXL handshake with {url} failed: {type(exc).__name__}", "transfer") from None
    if response.status_code != 200:
        raise PdFailure("NIXL read of unknown or expired blocks", "unknown_handle")
    return len(block_ids)


def mooncake_remote(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a vLLM Mooncake decode request that asks for a remote prefill
    (`do_remote_prefill` with `transfer_id`, `remote_engine_id` and `remote_bootstrap_addr`, as
    `update_state_after_alloc` requires), else None (the request then runs aggregated)."""
    params = nixl_remote(body)
    if params is None or not all(params.get(k) for k in (TRANSFER_ID, REMOTE_ENGINE_ID, REMOTE_BOOTSTRAP_ADDR)):
        return None
    return params


async def mooncake_pull(params: dict[str, Any], timeout_s: float, client: Callable[[], httpx.AsyncClient]) -> int:
    """Decode: take the KV of `params["transfer_id"]` from the prefill worker behind
    `remote_bootstrap_addr`; returns its prompt tokens. Raises PdFailure when that worker does not
    know the transfer, it failed, or it did not come within `timeout_s`."""
    addr = str(params[REMOTE_BOOTSTRAP_ADDR]).rstrip("/")
    url = (addr if addr.startswith(("http://", "https://")) else f"http://{addr}") + MOONCAKE_PULL_PATH
    try:
        response = await client().post(url, json={TRANSFER_ID: params[TRANSFER_ID],
                                                  REMOTE_ENGINE_ID: params[REMOTE_ENGINE_ID],
                                                  "timeout_s": timeout_s}, timeout=timeout_s + 5.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise PdFailure(f"Mooncake bootstrap {url} unreachable: {type(exc).__name__}", "transfer") from None
    if response.status_code == 200:
        return int(response.json().get("tokens", 0))
    kind = {404: "unknown_handle", 408: "transfer"}.get(response.status_code, "transfer")
    raise PdFailure(f"Mooncake transfer {params['transfer_id']} failed (HTTP {response.status_code})", kind)


def new_request_id(kind: str, headers: dict[str, str]) -> str:
    """vLLM's internal request id: `chatcmpl-` / `cmpl-` + the `X-Request-Id` header (or a fresh
    hex id) + an 8-hex-digit suffix (`InputProcessor.assign_request_id`)."""
    base = headers.get("x-request-id") or uuid.uuid4().hex
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}-{secrets.token_hex(4)}"
