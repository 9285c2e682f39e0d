"""LoRA adapters loaded on demand (a pool's `lora_on_demand`), through the engines' runtime endpoints,
and unloaded to make room (`lora_evict: lru`).

The engines' endpoints (`ENDPOINTS`), the same request body `{"lora_name", "lora_path"}` to load and
`{"lora_name"}` to unload:
- vLLM (and vllm-ascend) started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` serve
  `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vllm/entrypoints/openai/api_server.py;
  the checks and answers in vllm/entrypoints/openai/serving_models.py `load_lora_adapter`,
  `unload_lora_adapter`): 200 and a plain-text line when done; 400 `InvalidUserInput` for a name
  already loaded ("... has already been loaded.") or missing fields; 404 when the path holds no
  adapter (vllm/exceptions.py `LoRAAdapterNotFoundError`) or an unload names none it has ("...
  cannot be found."); 404 for the routes themselves when runtime updating is off. vLLM refuses no
  load for capacity: past `--max-cpu-loras` it drops its least recently used adapter from its CPU
  cache and reloads it from its path when asked (vllm/lora/worker_manager.py
  `LRUCacheWorkerLoRAManager`), so a pool's `max_loras` is the gateway's own bound there.
- SGLang serves `POST /load_lora_adapter` and `/unload_lora_adapter` (python/sglang/srt/entrypoints/
  http_server.py), answering 200 or 400 with a `LoRAUpdateOutput` (`success`, `error_message`,
  `loaded_adapters`; python/sglang/srt/managers/io_struct.py; the request is `LoadLoRAAdapterReqInput`,
  whose `pinned` the gateway leaves false: a pinned adapter never leaves SGLang's GPU pool). Its
  refusals: LoRA not enabled (`--enable-lora`); "Maximum number of loaded LoRA adapters is N"
  (`--max-loaded-loras`; python/sglang/srt/managers/tokenizer_manager.py `load_lora_adapter`); "...
  because it is already loaded" (python/sglang/srt/lora/lora_manager.py `validate_new_adapter`); a
  path without an adapter (whatever `LoRAConfig` raised); an unload of an unknown name "LoRA with
  name X does not exist" (python/sglang/srt/lora/lora_registry.py `unregister`). Its unload waits
  for the adapter's running requests to finish (`wait_for_unload`).
MindIE has a load endpoint too, but on its management port with a `master_mode` field; the gateway
has no MindIE engine kind, and `lora_on_demand` needs a vllm, ascend or sglang pool
(gateway/backends/pool_params.py).

A request for an adapter no worker of its pools has loaded loads it, once per adapter at a time
(other requests for it wait for that load), on the first pool that loads it on demand and has a
candidate worker for it (`plan_load`): the least-loaded worker under its pool's `max_loras`, else,
with `lora_evict: lru`, the least-loaded worker with an adapter to give up (`eviction_choice`),
which is unloaded first. Loads and unloads on one worker are serialized, at most one unload per
load (and one more after SGLang's `--max-loaded-loras` refusal), each within `timeout`. The engine's
error (status and message) goes back to the client as is (`LoraLoadFailed`); the worker then lists
the adapter (`WorkerRegistry.adapter_loaded`; its next `/v1/models` check confirms it). An engine
answering that it has the adapter already (another replica's or serving process's load) counts as
loaded, not as this gateway's to unload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from gateway.backends.control import describe_transport_error
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.errors import GatewayError, NoCapacity, UpstreamError

log = logging.getLogger("gateway.lora")


@dataclass(frozen=True, slots=True)
class LoraEndpoints:
    """One engine's runtime LoRA endpoints (module docstring) and the words of its refusals the
    gateway acts on: `already` (the name is loaded), `gone` (an unload of a name it lacks), `full`
    (its own slot bound; None: it has none)."""

    load: str
    unload: str
    already: str
    gone: str
    full: str | None


_VLLM = LoraEndpoints("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "has already been loaded",
                      "cannot be found", None)
ENDPOINTS: dict[str, LoraEndpoints] = {
    "vllm": _VLLM,
    "ascend": _VLLM,
    "sglang": LoraEndpoints("/load_lora_adapter", "/unload_lora_adapter", "because it is already loaded",
                            "does not exist", "Maximum number of loaded LoRA adapters"),
}


class LoraLoadFailed(GatewayError):
    """The engine refused to load an adapter: its status (4xx) and message, relayed."""

    error_type = "invalid_request_error"
    code = "lora_load_failed"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, param="model")
        self.status = status


class LoraSlotsFull(LoraLoadFailed):
    """The engine refused the load for its own slot bound (SGLang's `--max-loaded-loras`)."""


def has_room(worker: Worker, pool: PoolConfig) -> bool:
    """Whether `worker` has fewer than its pool's `max_loras` of the pool's on-demand adapters
    loaded (always, without a bound)."""
    if pool.max_loras is None:
        return True
    loaded = worker.adapters or frozenset()
    return sum(m.name in loaded for m in pool.lora_on_demand) < pool.max_loras


def eviction_choice(owned: Mapping[str, tuple[str, float]], in_flight: Mapping[str, int],
                    used_at: Mapping[str, float], now: float, grace: float,
                    keep: Collection[str] = ()) -> str | None:
    """The LoRA adapter to unload from a worker to make room, or None when none may go.

    `owned`: the adapters this gateway loaded there, name -> (path, load time); `in_flight`: this
    process's requests naming each there now; `used_at`: when one last started or ended there
    (else its load time); times are time.monotonic() s, `now` the current one. An adapter may go
    when it is owned, not in `keep` (the pool's declared adapters, the one being loaded), has no
    request in flight and is not fresh: loaded less than `grace` s ago with no request since (the
    request that loaded it may still be waiting for a slot). Among those, the least recently used
    (ties: the name, so the choice is stable).
    """
    free = [name for name, (_, loaded_at) in owned.items()
            if name not in keep and in_flight.get(name, 0) <= 0
            and not (now - loaded_at < grace and used_at.get(name, loaded_at) <= loaded_at)]
    return min(free, key=lambda name: (used_at.get(name, owned[name][1]), name), default=None)


def victim(worker: Worker, pool: PoolConfig, adapter: str, now: float) -> str | None:
    """`eviction_choice` on `worker` for loading `adapter` there (grace: the pool's `queue_timeout`)."""
    return eviction_choice(worker.on_demand, worker.adapter_in_flight, worker.adapter_used_at, now,
                           pool.queue_timeout, {*pool.lora_adapters, adapter})


def plan_load(workers: Sequence[Worker], pool: PoolConfig, adapter: str,
              now: float) -> tuple[Worker, str | None] | None:
    """Where to load `adapter` among `pool`'s candidate `workers`: (the worker, the adapter to
    unload there first or None). The least-loaded worker with room (`has_room`); else, with
    `lora_evict: lru`, the least-loaded one with an adapter to give up (`victim`); else None."""
    room = [w for w in workers if has_room(w, pool)]
    if room:
        return min(room, key=lambda w: w.load()), None
    if pool.lora_evict != "lru":
        return None
    options = [(w, v) for w in workers if (v := victim(w, pool, adapter, now)) is not None]
    return min(options, key=lambda o: o[0].load()) if options else None


class LoraLoader:
    """Loads on-demand LoRA adapters and unloads them to make room (module docstring). `client` is
    the gateway's control client; `timeout` (s) bounds one load or unload, connect to answer;
    `headers` are the pools' engine credentials."""

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, timeout: float,
                 headers: dict[str, dict[str, str]]) -> None:
        self.registry = registry
        self.client = client
        self.timeout = timeout
        self.headers = headers
        self._locks: dict[str, asyncio.Lock] = {}
        self._worker_locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, adapter: str, pools: Sequence[PoolConfig]) -> None:
        """Return once a candidate worker of `pools` (those serving `adapter`, in order) has it
        loaded, loading it if none has and a pool loads it on demand. Raises LoraLoadFailed (the
        engine's refusal), UpstreamError (no answer, or an unload that failed), NoCapacity (every
        worker at `max_loras` with nothing to unload); returns without loading when no pool loads
        it on demand (routing then finds none or one)."""
        if self._loaded_somewhere(adapter, pools) or not any(p.adapter_path(adapter) for p in pools):
            return
        lock = self._locks.setdefault(adapter, asyncio.Lock())
        async with lock:
            if self._loaded_somewhere(adapter, pools):  # another request loaded it meanwhile
                return
            for pool in pools:
                path = pool.adapter_path(adapter)
                if path is None:
                    continue
                plan = plan_load(self.registry.candidates(pool.name), pool, adapter, time.monotonic())
                if plan is not None:
                    await self._load_on(plan[0], pool, adapter, path)
                    return
            raise NoCapacity(f"No worker can load LoRA adapter `{adapter[:200]}`: every candidate of its pools "
                             "has its max_loras adapters loaded (none to unload), or none is in service.")

    def _loaded_somewhere(self, adapter: str, pools: Sequence[PoolConfig]) -> bool:
        return any(self.registry.candidates(p.name, (), None, adapter) for p in pools)

    async def _load_on(self, worker: Worker, pool: PoolConfig, adapter: str, path: str) -> None:
        """Load `adapter` on `worker`, unloading one adapter first when it has no room (looked at
        again under the worker's lock: another adapter's load may have filled it meanwhile)."""
        async with self._worker_locks.setdefault(worker.id, asyncio.Lock()):
            if not has_room(worker, pool):
                await self._make_room(worker, pool, adapter, None)
            try:
                await self._load(worker, pool, adapter, path)
            except LoraSlotsFull as full:
                if pool.lora_evict != "lru":
                    raise
                await self._make_room(worker, pool, adapter, full)
                await self._load(worker, pool, adapter, path)  # once: a second refusal is the client's answer

    async def _make_room(self, worker: Worker, pool: PoolConfig, adapter: str,
                         refusal: LoraSlotsFull | None) -> None:
        """Unload `worker`'s `victim`; without one, raise `refusal` (the engine's own) or NoCapacity."""
        name = victim(worker, pool, adapter, time.monotonic()) if pool.lora_evict == "lru" else None
        if name is None:
            if refusal is not None:
                raise refusal
            raise NoCapacity(f"No worker can load LoRA adapter `{adapter[:200]}`: {worker.id} has its max_loras "
                             "adapters loaded and none it may unload.")
        await self._unload(worker, pool, name, adapter)

    async def _post(self, worker: Worker, path: str, body: dict[str, str]) -> httpx.Response:
        url = worker.url + path
        try:
            return await self.client.post(url, content=orjson.dumps(body),
                                          headers={"content-type": "application/json",
                                                   **self.headers.get(worker.pool, {})},
                                          timeout=httpx.Timeout(self.timeout))
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{path} on {worker.id} failed: {describe_transport_error(exc, url)}") from None

    def _count(self, kind: str, pool: str, outcome: str) -> None:
        metrics = self.registry.metrics
        if metrics is not None:
            (metrics.lora_load if kind == "load" else metrics.lora_unload)(pool, outcome)

    async def _load(self, worker: Worker, pool: PoolConfig, adapter: str, path: str) -> None:
        endpoints = ENDPOINTS[worker.engine.kind]
        try:
            answer = await self._post(worker, endpoints.load, {"lora_name": adapter, "lora_path": path})
        except UpstreamError as exc:
            self._count("load", pool.name, "error")
            raise UpstreamError(f"Loading LoRA adapter `{adapter[:200]}`: {exc}") from None
        if answer.status_code == 200:
            log.info("worker %s loaded LoRA adapter %s from %s", worker.id, adapter, path)
            self._count("load", pool.name, "ok")
            self.registry.adapter_loaded(worker, adapter, path)
            return
        message = engine_message(answer.content) or f"{endpoints.load} answered HTTP {answer.status_code}"
        if 400 <= answer.status_code < 500 and endpoints.already in message:
            log.info("worker %s has LoRA adapter %s loaded already (%s)", worker.id, adapter, message)
            self._count("load", pool.name, "already_loaded")
            self.registry.adapter_loaded(worker, adapter)
            return
        log.warning("worker %s could not load LoRA adapter %s: %s", worker.id, adapter, message)
        if endpoints.full is not None and endpoints.full in message and 400 <= answer.status_code < 500:
            self._count("load", pool.name, "full")
            raise LoraSlotsFull(answer.status_code, message)
        if 400 <= answer.status_code < 500:
            self._count("load", pool.name, "refused")
            raise LoraLoadFailed(answer.status_code, message)
        self._count("load", pool.name, "error")
        raise UpstreamError(f"Loading LoRA adapter `{adapter[:200]}` on {worker.id} failed: {message}")

    async def _unload(self, worker: Worker, pool: PoolConfig, name: str, for_adapter: str) -> None:
        """Unload `name` from `worker`: out of its adapters first (no request is sent there meanwhile;
        nothing awaits between `victim`'s look at its in-flight requests and this), then the
        engine's unload. An engine that no longer has it is done too; any other failure puts it
        back and raises UpstreamError (the worker's state is not known: no load follows)."""
        path, _ = worker.on_demand[name]
        self.registry.adapter_unloaded(worker, name)
        endpoints = ENDPOINTS[worker.engine.kind]
        try:
            answer = await self._post(worker, endpoints.unload, {"lora_name": name})
        except UpstreamError as exc:
            self._count("unload", pool.name, "error")
            self.registry.adapter_loaded(worker, name, path)
            raise UpstreamError(f"Unloading LoRA adapter `{name}` to load `{for_adapter[:200]}`: {exc}") from None
        message = engine_message(answer.content) or f"{endpoints.unload} answered HTTP {answer.status_code}"
        if answer.status_code == 200 or (400 <= answer.status_code < 500 and endpoints.gone in message):
            outcome = "ok" if answer.status_code == 200 else "gone"
            log.info("worker %s unloaded LoRA adapter %s (%s; least recently used on-demand adapter, to load %s)",
                     worker.id, name, outcome, for_adapter)
            self._count("unload", pool.name, outcome)
            return
        self._count("unload", pool.name, "refused" if 400 <= answer.status_code < 500 else "error")
        log.warning("worker %s could not unload LoRA adapter %s: %s", worker.id, name, message)
        self.registry.adapter_loaded(worker, name, path)
        raise UpstreamError(f"Unloading LoRA adapter `{name}` on {worker.id} to load `{for_adapter[:200]}` "
                            f"failed: {message}")


def engine_message(body: bytes) -> str | None:
    """The `message` of an engine's error body (`{"error": {"message"}}`, vLLM's older flat
    `{"object": "error", "message"}`, SGLang's `LoRAUpdateOutput` `{"success": false,
    "error_message"}`), else its text (at most 500 characters), None when empty."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return text[:500] or None
    if isinstance(payload, dict):
        if isinstance(payload.get("error_message"), str) and payload["error_message"]:
            return str(payload["error_message"])[:500]
        inner = payload["error"] if isinstance(payload.get("error"), dict) else payload
        if isinstance(inner.get("message"), str):
            return str(inner["message"])[:500]
    return None
