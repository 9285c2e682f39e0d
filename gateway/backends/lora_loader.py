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
which is unloaded first. Only a request that will be served loads one (gateway/dispatch/service.py
calls `ensure` after every refusal a request can get before its engine: limits, a follow-up's owner).
Before it plans, a pool with a bound (`max_loras` or `lora_evict: lru`) reads its candidates'
`/v1/models` again (`HealthChecker.read_adapters`): another replica or serving process may have
loaded or unloaded adapters there since the last check. Loads and unloads on one worker are
serialized within this process, at most one unload per load (and one more after SGLang's
`--max-loaded-loras` refusal), each within `timeout`. The engine's error (status and message) goes
back to the client as is (`LoraLoadFailed`); the worker then lists the adapter
(`WorkerRegistry.adapter_loaded`; its next `/v1/models` check confirms it). An engine answering that
it has the adapter already (another replica's or serving process's load) counts as loaded.

Which adapters may be unloaded is the configuration's word: the pool's on-demand adapters a worker
lists, whoever loaded them (`WorkerRegistry.set_adapters`), so a restarted replica, or one that
never loaded them, frees slots as well as the one that did. Which of them goes is judged by the
fleet's use (gateway/backends/lora_slots.py: shared through Redis with `redis_url`): never one with
a request in flight in any replica, nor one freshly loaded that no request used yet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from gateway.backends.control import describe_transport_error
from gateway.backends.lora_slots import NO_USE, LoraSlots, SlotUse, local_use
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


def eviction_choice(owned: Collection[str], use: SlotUse, now: float, grace: float,
                    keep: Collection[str] = ()) -> str | None:
    """The LoRA adapter to unload from a worker to make room, or None when none may go.

    `owned`: the adapters there the gateway may unload (`Worker.on_demand`); `use`: what is known
    of their use there (`lora_slots.SlotUse`, unix s; `now` the current time). An adapter may go
    when it is owned, not in `keep` (the pool's declared adapters, the one being loaded), has no
    request in flight and is not fresh: loaded less than `grace` s ago with no request since (the
    request that loaded it may still be waiting for a slot). Among those, the least recently used,
    one never seen used counting from its load, and one of unknown load and use first (ties: the
    name, so the choice is stable).
    """
    def fresh(name: str) -> bool:
        loaded = use.loaded_at.get(name)
        return loaded is not None and now - loaded < grace and use.used_at.get(name, loaded) <= loaded

    free = [name for name in owned if name not in keep and name not in use.busy and not fresh(name)]
    return min(free, key=lambda name: (use.used_at.get(name, use.loaded_at.get(name, -math.inf)), name),
               default=None)


def victim(worker: Worker, pool: PoolConfig, adapter: str, now: float, fleet: SlotUse = NO_USE) -> str | None:
    """`eviction_choice` on `worker` for loading `adapter` there (grace: the pool's `queue_timeout`),
    judged by this process's use there now merged with the `fleet`'s (`LoraSlots.fleet_use`)."""
    return eviction_choice(worker.on_demand, local_use(worker).merged(fleet), now, pool.queue_timeout,
                           {*pool.lora_adapters, adapter})


def plan_load(workers: Sequence[Worker], pool: PoolConfig, adapter: str, now: float,
              fleet: Mapping[str, SlotUse] | None = None) -> tuple[Worker, str | None] | None:
    """Where to load `adapter` among `pool`'s candidate `workers`: (the worker, the adapter to
    unload there first or None). The least-loaded worker with room (`has_room`); else, with
    `lora_evict: lru`, the least-loaded one with an adapter to give up (`victim`, with the
    `fleet`'s use of each worker, by URL); else None. `now`: unix s."""
    room = [w for w in workers if has_room(w, pool)]
    if room:
        return min(room, key=lambda w: w.load()), None
    if pool.lora_evict != "lru":
        return None
    fleet = fleet or {}
    options = [(w, v) for w in workers if (v := victim(w, pool, adapter, now, fleet.get(w.url, NO_USE))) is not None]
    return min(options, key=lambda o: o[0].load()) if options else None


class LoraLoader:
    """Loads on-demand LoRA adapters and unloads them to make room (module docstring). `client` is
    the gateway's control client; `timeout` (s) bounds one load or unload, connect to answer;
    `headers` are the pools' engine credentials; `slots` the fleet's use of the adapters (None:
    this process's own); `read_adapters` reads a worker's `/v1/models` for its adapters
    (`HealthChecker.read_adapters`; None: the last check's list is used)."""

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, timeout: float,
                 headers: dict[str, dict[str, str]], slots: LoraSlots | None = None,
                 read_adapters: Callable[[Worker], Awaitable[None]] | None = None) -> None:
        self.registry = registry
        self.client = client
        self.timeout = timeout
        self.headers = headers
        self.slots = slots
        self.read_adapters = read_adapters
        self._locks: dict[str, asyncio.Lock] = {}
        self._worker_locks: dict[str, asyncio.Lock] = {}

    def loaded_somewhere(self, adapter: str, pools: Sequence[PoolConfig], only: Worker | None = None) -> bool:
        """Whether a candidate worker of `pools` (or `only`, when given) serves `adapter` now."""
        serving = (w for p in pools for w in self.registry.candidates(p.name, (), None, adapter))
        return any(only is None or w is only for w in serving)

    async def ensure(self, adapter: str, pools: Sequence[PoolConfig], only: Worker | None = None) -> bool:
        """Return once a candidate worker of `pools` (those serving `adapter`, in order; `only`: that
        worker alone, a Responses follow-up's owner) has it loaded, loading it if none has and a pool
        loads it on demand. True when this call loaded it (the request it was loaded for caused that
        work: gateway/dispatch/ledger.py `Ledger.adapter_loaded`). Raises LoraLoadFailed (the
        engine's refusal), UpstreamError (no answer, or an unload that failed), NoCapacity (every
        worker at `max_loras` with nothing to unload); returns False without loading when no pool
        loads it on demand (routing then finds none or one)."""
        if self.loaded_somewhere(adapter, pools, only) or not any(p.adapter_path(adapter) for p in pools):
            return False
        lock = self._locks.setdefault(adapter, asyncio.Lock())
        async with lock:
            if self.loaded_somewhere(adapter, pools, only):  # another request loaded it meanwhile
                return False
            for pool in pools:
                path = pool.adapter_path(adapter)
                if path is None:
                    continue
                workers = [w for w in self.registry.candidates(pool.name) if only is None or w is only]
                fleet = await self._look(pool, workers)
                if self.loaded_somewhere(adapter, [pool], only):  # another replica loaded it meanwhile
                    return False
                plan = plan_load(workers, pool, adapter, time.time(), fleet)
                if plan is not None:
                    await self._load_on(plan[0], pool, adapter, path)
                    return True
            raise NoCapacity(f"No worker can load LoRA adapter `{adapter[:200]}`: every candidate of its pools "
                             "has its max_loras adapters loaded (none to unload), or none is in service.")

    async def _look(self, pool: PoolConfig, workers: Sequence[Worker]) -> dict[str, SlotUse]:
        """For a pool with a bound (`max_loras`, `lora_evict: lru`): each worker's adapters read
        again (`read_adapters`), then, for `lru`, the fleet's use of them by worker URL."""
        if pool.max_loras is None and pool.lora_evict != "lru":
            return {}
        if self.read_adapters is not None:
            await asyncio.gather(*(self.read_adapters(w) for w in workers))
        if pool.lora_evict != "lru" or self.slots is None:
            return {}
        return {w.url: await self.slots.fleet_use(w) for w in workers}

    def adapter_gone(self, worker: Worker, adapter: str) -> None:
        """`worker`'s engine answered that it has no `adapter` (another replica unloaded it since
        this process last read its list): it no longer serves it here, until a load or a list says so."""
        log.info("worker %s no longer has LoRA adapter %s (its engine said so)", worker.id, adapter)
        self.registry.adapter_unloaded(worker, adapter)

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
        """Unload `worker`'s `victim` (judged by the fleet's use, read now); without one, raise
        `refusal` (the engine's own) or NoCapacity."""
        name = None
        if pool.lora_evict == "lru":
            fleet = await self.slots.fleet_use(worker) if self.slots is not None else NO_USE
            name = victim(worker, pool, adapter, time.time(), fleet)  # nothing awaits from here to the unload
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
            if self.slots is not None:
                await self.slots.loaded(worker, adapter)
            return
        message = engine_message(answer.content) or f"{endpoints.load} answered HTTP {answer.status_code}"
        if 400 <= answer.status_code < 500 and endpoints.already in message:
            log.info("worker %s has LoRA adapter %s loaded already (%s)", worker.id, adapter, message)
            self._count("load", pool.name, "already_loaded")
            self.registry.adapter_loaded(worker, adapter, path)  # the pool's on-demand adapter: any replica's
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
            if self.slots is not None:
                await self.slots.unloaded(worker, name)
            return
        self._count("unload", pool.name, "refused" if 400 <= answer.status_code < 500 else "error")
        log.warning("worker %s could not unload LoRA adapter %s: %s", worker.id, name, message)
        self.registry.adapter_loaded(worker, name, path)
        raise UpstreamError(f"Unloading LoRA adapter `{name}` on {worker.id} to load `{for_adapter[:200]}` "
                            f"failed: {message}")


MISSING_ADAPTER = ("does not exist", "are not loaded")
"""How an engine words a request's refusal for an adapter it has not loaded: vLLM's 404 "The model
`X` does not exist. Valid aliases: ..." (vllm/entrypoints/serve/engine/serving.py `_check_model`),
SGLang's 400 "The following requested LoRA adapters are not loaded: X" (python/sglang/srt/lora/
lora_registry.py `acquire`, raised as a ValueError its OpenAI layer answers 400) or, where it
validates `model`, "The model `X` does not exist"."""


def adapter_missing(status: int | None, body: bytes, adapter: str) -> bool:
    """Whether an engine's refusal (`status`, `body`) of a request for LoRA `adapter` says it has no
    such adapter loaded (`MISSING_ADAPTER`, naming the adapter)."""
    if status not in (400, 404):
        return False
    message = engine_message(body) or ""
    return adapter in message and any(words in message for words in MISSING_ADAPTER)


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
