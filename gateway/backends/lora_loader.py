"""LoRA adapters loaded on demand (a pool's `lora_on_demand`), through vLLM's runtime endpoint.

vLLM (and vllm-ascend) started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` serve
`POST /v1/load_lora_adapter` with `{"lora_name", "lora_path"}` (vllm/entrypoints/openai/api_server.py;
the checks and answers in vllm/entrypoints/openai/serving_models.py `load_lora_adapter`): 200 and a
plain-text line when loaded; 400 for a name already loaded or missing fields; 404 when the path
holds no adapter (vllm/exceptions.py `LoRAAdapterNotFoundError`); 404 for the route itself when
runtime updating is off. The engine's error (status and message) goes back to the client as is.

A request for an adapter no worker of its pools has loaded loads it on the least-loaded candidate
of the first pool that loads it on demand and has a worker under its `max_loras`, once per
adapter at a time (other requests for it wait for that load), then routes as usual: the worker
now lists it (`WorkerRegistry.adapter_loaded`; its next `/v1/models` check confirms it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx
import orjson

from gateway.backends.control import describe_transport_error
from gateway.backends.pool_params import PoolConfig
from gateway.backends.registry import WorkerRegistry
from gateway.backends.worker import Worker
from gateway.errors import GatewayError, NoCapacity, UpstreamError

log = logging.getLogger("gateway.lora")

LOAD_PATH = "/v1/load_lora_adapter"


class LoraLoadFailed(GatewayError):
    """The engine refused to load an adapter: its status (4xx) and message, relayed."""

    error_type = "invalid_request_error"
    code = "lora_load_failed"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, param="model")
        self.status = status


class LoraLoader:
    """Loads on-demand LoRA adapters (module docstring). `client` is the gateway's control client;
    `timeout` (s) bounds one load, connect to answer; `headers` are the pools' engine credentials."""

    def __init__(self, registry: WorkerRegistry, client: httpx.AsyncClient, timeout: float,
                 headers: dict[str, dict[str, str]]) -> None:
        self.registry = registry
        self.client = client
        self.timeout = timeout
        self.headers = headers
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, adapter: str, pools: Sequence[PoolConfig]) -> None:
        """Return once a candidate worker of `pools` (those serving `adapter`, in order) has it
        loaded, loading it if none has and a pool loads it on demand. Raises LoraLoadFailed (the
        engine's refusal), UpstreamError (no answer), NoCapacity (every worker at `max_loras`);
        returns without loading when no pool loads it on demand (routing then finds none or one)."""
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
                room = [w for w in self.registry.candidates(pool.name) if self._has_room(w, pool)]
                if room:
                    await self._load(min(room, key=lambda w: w.load()), adapter, path)
                    return
            raise NoCapacity(f"No worker can load LoRA adapter `{adapter[:200]}`: every candidate of its pools "
                             "has its max_loras adapters loaded, or none is in service.")

    def _loaded_somewhere(self, adapter: str, pools: Sequence[PoolConfig]) -> bool:
        return any(self.registry.candidates(p.name, (), None, adapter) for p in pools)

    @staticmethod
    def _has_room(worker: Worker, pool: PoolConfig) -> bool:
        if pool.max_loras is None:
            return True
        loaded = worker.adapters or frozenset()
        return sum(m.name in loaded for m in pool.lora_on_demand) < pool.max_loras

    async def _load(self, worker: Worker, adapter: str, path: str) -> None:
        url = worker.url + LOAD_PATH
        try:
            answer = await self.client.post(url, content=orjson.dumps({"lora_name": adapter, "lora_path": path}),
                                            headers={"content-type": "application/json",
                                                     **self.headers.get(worker.pool, {})},
                                            timeout=httpx.Timeout(self.timeout))
        except httpx.HTTPError as exc:
            raise UpstreamError(f"Loading LoRA adapter `{adapter[:200]}` on {worker.id} failed: "
                                f"{describe_transport_error(exc, url)}") from None
        if answer.status_code == 200:
            log.info("worker %s loaded LoRA adapter %s from %s", worker.id, adapter, path)
            self.registry.adapter_loaded(worker, adapter)
            return
        message = engine_message(answer.content) or f"{LOAD_PATH} answered HTTP {answer.status_code}"
        log.warning("worker %s could not load LoRA adapter %s: %s", worker.id, adapter, message)
        if 400 <= answer.status_code < 500:
            raise LoraLoadFailed(answer.status_code, message)
        raise UpstreamError(f"Loading LoRA adapter `{adapter[:200]}` on {worker.id} failed: {message}")


def engine_message(body: bytes) -> str | None:
    """The `message` of an engine's error body (`{"error": {"message"}}` or vLLM's older flat
    `{"object": "error", "message"}`), else its text (at most 500 characters), None when empty."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return text[:500] or None
    if isinstance(payload, dict):
        inner = payload["error"] if isinstance(payload.get("error"), dict) else payload
        if isinstance(inner.get("message"), str):
            return str(inner["message"])[:500]
    return None
