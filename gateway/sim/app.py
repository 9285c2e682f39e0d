"""The simulator's ASGI application: routes of a vLLM / SGLang / vllm-ascend OpenAI server.

Engine endpoints:
    POST /v1/chat/completions, POST /v1/completions   (see `gateway.sim.generation`)
    POST /v1/responses, GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel
                       (the Responses API with in-memory stored responses: `gateway.sim.responses_api`)
    POST /v1/embeddings, POST /v1/rerank (/rerank, /v2/rerank), POST /v1/score (/score)
                       with `pooling` only: the pooling APIs in vLLM's shapes (`gateway.sim.pooling`)
    POST /v1/messages, POST /v1/messages/count_tokens Anthropic's Messages API (`gateway.sim.anthropic`;
                                                      api_version "current" only, as the engines added it in 2026)
    GET /health        vLLM family: 200 with an empty body at once. SGLang: its generating health check
                       (also at /health_generate): 200 or 503 after at least `health_generate_poll_s`
                       (`SimApp._health_generate`). Never answers with the `hang_health` or `black_hole`
                       fault; trickles or never ends with `health_body`
    GET /model_info    SGLang only (also at /get_model_info): the model's facts at once, the probe faults apply
    GET /ready         SGLang only: 200 at once once up (the gateway's probe of SGLang workers), the probe faults apply
    GET /v1/models     OpenAI model list with the served names, then the loaded LoRA adapters (`parent` set)
    POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter
                       vLLM family with `runtime_lora_updating` only: vLLM's runtime LoRA loading
    POST /load_lora_adapter, POST /unload_lora_adapter
                       SGLang: its runtime LoRA loading (`LoRAUpdateOutput` answers; refused unless
                       `runtime_lora_updating` or `lora_modules`, its `--enable-lora`)
    GET /metrics       Prometheus text with the engine's own metric names (or a trickling or
                       endless body with `metrics_body`)
    POST /v1/chat/completions/render, POST /v1/completions/render, POST /tokenize, POST /detokenize
                       vLLM family: a prompt's token ids, token ids' text (`gateway.sim.render`);
                       SGLang: its own /tokenize and /detokenize (also under /v1)
With `SimConfig.api_key`, the engine's guarded paths (or every path: `api_key_scope`) answer 401
to a request without the key.
Test endpoints:
    GET /sim/requests, DELETE /sim/requests     request records (JSON list) / clear them
    GET /sim/timings, DELETE /sim/timings       compact timings of the last `timing_records`
                                                requests (`gateway.sim.timings`) / clear them
    GET /sim/faults, POST /sim/faults           global faults (JSON `SimFaults`; POST replaces)
    GET /sim/script, POST /sim/script           scripted answers (JSON `SimScript`, gateway.sim.script;
                                                POST replaces, `{}` clears)
    GET /sim/stats, DELETE /sim/stats           running totals of this worker (JSON object, see
                                                `SimWorkerState.sim_stats`) / restart them (DELETE
                                                answers the totals just before the reset)
    DELETE /sim/cache                           empty the prefix cache (blocks of running
                                                requests stay): `{"dropped_tokens": N}`
PD side channels (workers with a `pd_role`, see `gateway.sim.pd`):
    POST /sim/pd/sglang/rooms/{room}            SGLang prefill: a decode worker's bootstrap for a
                                                room, `{"timeout_s": S}`; 200 once the KV is ready,
                                                408 after S seconds, 500 when the prefill failed
    POST /sim/pd/nixl/read                      vLLM NIXL prefill: read (and free) held blocks,
                                                `{"remote_engine_id","remote_request_id",
                                                "remote_block_ids"}`; 200, or 404 when unknown
    POST /sim/pd/mooncake/pull                  vLLM Mooncake prefill: take the KV of a transfer,
                                                `{"transfer_id","remote_engine_id","timeout_s"}`;
                                                200 `{"tokens": N}` once ready, 404 (other
                                                engine), 408 (timeout), 500 (prefill failed)
    GET /query                                  vLLM Mooncake prefill: the bootstrap server's
                                                engine table (`gateway.sim.pd`)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from gateway.protocol.pd import MOONCAKE_QUERY_PATH
from gateway.sim import render
from gateway.sim import responses as r
from gateway.sim.asgi import (
    ClientDisconnected,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    lower_headers,
    read_body,
    send_bytes,
    send_json,
)
from gateway.sim.config import BodyMode, SimConfig, SimFaults
from gateway.sim.generation import PooledAnswer, handle_generation, handle_pooled
from gateway.sim.pd import MOONCAKE_PULL_PATH, NIXL_READ_PATH, SGLANG_ROOMS_PATH
from gateway.sim.pooling import (
    EMBEDDINGS_PATH,
    RERANK_PATHS,
    SCORE_PATHS,
    embeddings_answer,
    rerank_answer,
    score_answer,
)
from gateway.sim.responses_api import ResponsesServer
from gateway.sim.script import SimScript
from gateway.sim.tokens import FieldValidationError
from gateway.sim.worker_state import SimWorkerState

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class SimApp:
    """ASGI app of one simulated engine; `engine` exposes its state to in-process tests."""

    def __init__(self, engine: SimWorkerState) -> None:
        self.engine = engine
        self.responses = ResponsesServer(engine)
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self.responses.create,
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/sim/requests"): self._get_requests,
            ("DELETE", "/sim/requests"): self._clear_requests,
            ("GET", "/sim/timings"): self._get_timings,
            ("DELETE", "/sim/timings"): self._clear_timings,
            ("GET", "/sim/faults"): self._get_faults,
            ("POST", "/sim/faults"): self._set_faults,
            ("GET", "/sim/script"): self._get_script,
            ("POST", "/sim/script"): self._set_script,
            ("GET", "/sim/stats"): self._get_stats,
            ("DELETE", "/sim/stats"): self._reset_stats,
            ("DELETE", "/sim/cache"): self._clear_cache,
            ("POST", NIXL_READ_PATH): self._nixl_read,
            ("POST", MOONCAKE_PULL_PATH): self._mooncake_pull,
            ("GET", MOONCAKE_QUERY_PATH): self._mooncake_query,
        }
        if engine.config.api_version == "current":
            self._routes[("POST", "/v1/messages")] = self._messages
            self._routes[("POST", "/v1/messages/count_tokens")] = self._count_tokens
        if engine.config.runtime_lora_updating and engine.config.engine in ("vllm", "ascend"):
            self._routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            self._routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora
        if engine.config.engine == "sglang":
            for path in ("/health", "/health_generate"):
                self._routes[("GET", path)] = self._health_generate
            for path in ("/model_info", "/get_model_info"):
                self._routes[("GET", path)] = self._model_info
            self._routes[("GET", "/ready")] = self._ready
            self._routes[("POST", "/load_lora_adapter")] = self._sglang_load_lora
            self._routes[("POST", "/unload_lora_adapter")] = self._sglang_unload_lora
        if engine.config.pooling:
            self._routes[("POST", EMBEDDINGS_PATH)] = self._pooled(embeddings_answer)
            for path in RERANK_PATHS:
                self._routes[("POST", path)] = self._pooled(rerank_answer)
            for path in SCORE_PATHS:
                self._routes[("POST", path)] = self._pooled(score_answer)
        if render.serves_render(engine):
            self._routes[("POST", render.CHAT_RENDER_PATH)] = self._render_chat
            self._routes[("POST", render.COMPLETIONS_RENDER_PATH)] = self._render_completion
        if render.serves_tokenize(engine):
            self._routes[("POST", render.TOKENIZE_PATH)] = self._tokenize
            self._routes[("POST", render.DETOKENIZE_PATH)] = self._detokenize
        if render.serves_sglang_tokenize(engine):
            for prefix in ("", "/v1"):
                self._routes[("POST", prefix + render.TOKENIZE_PATH)] = self._sglang_tokenize
                self._routes[("POST", prefix + render.DETOKENIZE_PATH)] = self._sglang_detokenize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        if not self._authorized(scope, path):
            await send_json(send, 401, {"error": "Unauthorized"})
            return
        handler = self._routes.get((scope["method"], path))
        if handler is None and scope["method"] == "POST" and path.startswith(SGLANG_ROOMS_PATH):
            handler = self._sglang_room
        if handler is not None and path.endswith("_lora_adapter") and self.engine.faults.no_lora_routes:
            handler = None
        if handler is not None:
            await handler(scope, receive, send)
        elif path.startswith("/v1/responses/"):
            await self.responses.by_id(scope, receive, send)
        elif any(p == path for _, p in self._routes):
            await send_json(send, 405, {"detail": "Method Not Allowed"})
        else:
            await send_json(send, 404, {"detail": "Not Found"})

    def _authorized(self, scope: Scope, path: str) -> bool:
        """False when the path is guarded by `api_key` and the request lacks `Bearer <api_key>`
        (an exact match, as vLLM and SGLang compare it)."""
        config = self.engine.config
        if config.api_key is None or scope["method"] == "OPTIONS" or path.startswith("/sim/"):
            return True
        if config.api_key_scope == "engine":
            if config.engine == "sglang":  # SGLang's middleware lets health, readiness and metrics through
                guarded = not path.startswith(("/health", "/ready", "/metrics"))  # sglang/srt/utils/auth.py
            else:  # vLLM's (and vllm-ascend's) guards the OpenAI API only
                guarded = path.startswith("/v1")
            if not guarded:
                return True
        return lower_headers(scope).get("authorization") == f"Bearer {config.api_key}"

    async def _hostile_body(self, mode: BodyMode, receive: Receive, send: Send) -> None:
        """200, then a body that never ends: one byte every `trickle_interval_s` ("trickle") or
        64 KiB writes as fast as the client reads ("endless"); returns once the client left."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        chunk = b"#" if mode == "trickle" else b"# " + b"x" * 65533 + b"\n"
        async with DisconnectWatch(receive) as watch:
            try:
                while not watch.disconnected:
                    # uvicorn's send waits while the client does not read, and returns at once
                    # (dropping the data) after a disconnect, which the watch then reports.
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if mode == "trickle":
                        await watch.sleep(self.engine.faults.trickle_interval_s)
                    else:
                        await asyncio.sleep(0)  # let the disconnect listener run between writes
            except ClientDisconnected:
                return

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _pd_json(self, receive: Receive, send: Send) -> dict[str, Any] | None:
        """The JSON object body of a PD side channel call; answers 404 (not a PD prefill
        worker) or 422 itself and returns None."""
        raw = await read_body(receive)
        if raw is None:
            return None
        if self.engine.pd is None or self.engine.config.pd_role != "prefill":
            await send_json(send, 404, {"detail": "Not a prefill worker"})
            return None
        try:
            body = orjson.loads(raw or b"{}")
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            await send_json(send, 422, {"detail": "expected a JSON object"})
            return None
        return body

    async def _sglang_room(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._pd_json(receive, send)
        if body is None:
            return
        try:
            room = int(scope["path"].rstrip("/")[len(SGLANG_ROOMS_PATH):])
            timeout_s = float(body.get("timeout_s", self.engine.config.pd_wait_timeout_s))
        except ValueError:
            await send_json(send, 422, {"detail": "bad room or timeout_s"})
            return
        assert self.engine.pd is not None
        async with DisconnectWatch(receive) as watch:
            try:
                status, reason = await watch.run(self.engine.pd.sglang_claim(room, timeout_s))
                if self.engine.faults.black_hole:  # wedged meanwhile: its decode partners hear nothing
                    await watch.until_disconnected()
            except ClientDisconnected:
                return
        await send_json(send, status, {"room": room, "failed": reason})

    async def _mooncake_query(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = self.engine.config
        if self.engine.pd is None or config.pd_role != "prefill" or config.pd_protocol != "vllm-mooncake":
            await send_json(send, 404, {"detail": "Not Found"})
            return
        port = (scope.get("server") or ("127.0.0.1", 0))[1]
        await send_json(send, 200, self.engine.pd.mooncake_query(config.side_channel_host, int(port or 0)))

    async def _mooncake_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._pd_json(receive, send)
        if body is None:
            return
        assert self.engine.pd is not None
        try:
            timeout_s = float(body.get("timeout_s", self.engine.config.pd_wait_timeout_s))
        except (TypeError, ValueError):
            await send_json(send, 422, {"detail": "bad timeout_s"})
            return
        async with DisconnectWatch(receive) as watch:
            try:
                status, tokens = await watch.run(self.engine.pd.mooncake_pull(
                    str(body.get("transfer_id")), body.get("remote_engine_id"), timeout_s))
                if self.engine.faults.black_hole:  # wedged meanwhile: its decode partners hear nothing
                    await watch.until_disconnected()
            except ClientDisconnected:
                return
        await send_json(send, status, {"tokens": tokens})

    async def _nixl_read(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._pd_json(receive, send)
        if body is None:
            return
        assert self.engine.pd is not None
        ok = self.engine.pd.nixl_read(body.get("remote_engine_id"), body.get("remote_request_id"),
                                      body.get("remote_block_ids"))
        await send_json(send, 200 if ok else 404, {"read": ok})

    def _pooled(self, answer: PooledAnswer) -> Handler:
        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            await handle_pooled(self.engine, answer, scope, receive, send)
        return serve

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle_generation(self.engine, "chat", scope, receive, send)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle_generation(self.engine, "text", scope, receive, send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle_generation(self.engine, "chat", scope, receive, send, anthropic="messages")

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle_generation(self.engine, "chat", scope, receive, send, anthropic="count_tokens")

    async def _render_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.render_chat(self.engine, scope, receive, send)

    async def _render_completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.render_completion(self.engine, scope, receive, send)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.tokenize(self.engine, scope, receive, send)

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.detokenize(self.engine, scope, receive, send)

    async def _sglang_tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.sglang_tokenize(self.engine, scope, receive, send)

    async def _sglang_detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await render.sglang_detokenize(self.engine, scope, receive, send)

    async def _probe_faults(self, receive: Receive, send: Send) -> bool:
        """Count a probe and play the probe faults (`hang_health`, `health_body`, `black_hole`);
        True when a fault answered (or the client left), so the endpoint must not."""
        self.engine.note_health_check()
        faults = self.engine.faults
        if faults.health_body != "normal" and not faults.black_hole:
            await self._hostile_body(faults.health_body, receive, send)
            return True
        if faults.hang_health or faults.black_hole:
            async with DisconnectWatch(receive) as watch:
                try:
                    await watch.until_disconnected()
                except ClientDisconnected:
                    return True
        return False

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await self._probe_faults(receive, send):
            await send_bytes(send, 200, b"", headers=[])

    async def _health_generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's `/health` and `/health_generate` (`health_generate` in
        `python/sglang/srt/entrypoints/http_server.py`): submit a one-token generation, then look
        every `health_generate_poll_s` (SGLang: 1 s) for scheduler output since the submission
        (`SimWorkerState.scheduler_answered`); 200 (empty body) at the first look that finds it,
        503 (empty body) once `health_generate_timeout_s` (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s)
        passed without. So it never answers before the first look, and fails while one long
        prefill keeps the scheduler from producing output."""
        if await self._probe_faults(receive, send):
            return
        config = self.engine.config
        mark = self.engine.scheduler_mark()
        deadline = time.monotonic() + config.health_generate_timeout_s
        async with DisconnectWatch(receive) as watch:
            try:
                while time.monotonic() < deadline:
                    await watch.sleep(config.health_generate_poll_s)
                    if self.engine.scheduler_answered(mark):
                        await send_bytes(send, 200, b"", headers=[])
                        return
            except ClientDisconnected:
                return
        await send_bytes(send, 503, b"", headers=[])

    async def _ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's `/ready`: 200 with an empty body once the server is up, at once, without the
        scheduler (`ready` in `python/sglang/srt/entrypoints/http_server.py`, 0.5.23:
        `tokenizer_manager.is_ready()`). The probe faults apply."""
        if await self._probe_faults(receive, send):
            return
        self.engine.note_health_check()
        await send_bytes(send, 200, b"", headers=[])

    async def _model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's `/model_info` (and its deprecated alias `/get_model_info`): the tokenizer
        manager's facts about the model, answered at once without the scheduler (`model_info` in
        `python/sglang/srt/entrypoints/http_server.py`). The probe faults apply."""
        if await self._probe_faults(receive, send):
            return
        name = self.engine.config.model_name
        await send_json(send, 200, {
            "model_path": name, "tokenizer_path": name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": None, "architectures": None,
        })

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.engine.note_models_read()
        config = self.engine.config
        await send_json(send, 200, r.models_list(config.served_model_names, config.max_context_tokens,
                                                 self.engine.dialect.owned_by, self.engine.started_at,
                                                 self.engine.loras))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.engine.faults.black_hole:
            async with DisconnectWatch(receive) as watch:
                try:
                    await watch.until_disconnected()
                except ClientDisconnected:
                    return
        if self.engine.faults.metrics_body != "normal":
            await self._hostile_body(self.engine.faults.metrics_body, receive, send)
            return
        body = generate_latest(self.engine.registry)
        await send_bytes(send, 200, body, headers=[(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _get_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, [record.to_json() for record in self.engine.records])

    async def _clear_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"cleared": self.engine.clear_records()})

    async def _get_timings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.engine.timings())

    async def _clear_timings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"cleared": self.engine.clear_timings()})

    async def _get_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.engine.sim_stats())

    async def _reset_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.engine.reset_stats())

    async def _clear_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"dropped_tokens": self.engine.clear_cache()})

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.engine.faults.model_dump())

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        faults = await _read_model(SimFaults, receive, send)
        if faults is not None:
            self.engine.set_faults(faults)
            await send_json(send, 200, faults.model_dump())

    async def _load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM 0.32's runtime load (vllm/entrypoints/openai/models/serving.py `load_lora_adapter` and
        `_check_load_lora_adapter_request`): a body its `LoadLoRAAdapterRequest` refuses (a field
        missing or no string, vllm/entrypoints/serve/lora/protocol.py) is the validation error;
        an empty name or path 400 `InvalidUserInput`, as are a base model's name and a loaded name
        (unless `load_inplace`, which loads it again); a path without an adapter 404 `NotFoundError`
        (vllm/exceptions.py `LoRAAdapterNotFoundError`'s words); success answers a plain-text line
        (the router's `Response(content=...)`, vllm/entrypoints/serve/lora/api_router.py)."""
        body = await _read_lora_request(self.engine, receive, send)
        if body is None:
            return
        fields = _lora_fields(body, ("lora_name", "lora_path"))
        dialect, loadable = self.engine.dialect, self.engine.config.lora_loadable_paths
        if isinstance(fields, FieldValidationError):
            reply = dialect.validation_error(fields)
        elif not fields["lora_name"] or not fields["lora_path"]:
            reply = dialect.error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        elif fields["lora_name"] in self.engine.config.served_model_names:
            reply = dialect.error(f"The lora adapter '{fields['lora_name']}' conflicts with a served base model.",
                                  "InvalidUserInput", 400)
        elif fields["lora_name"] in self.engine.loras and body.get("load_inplace") is not True:
            hint = (" If you want to load the adapter in place, set 'load_inplace' to True."
                    if dialect.api_version == "current" else "")  # vLLM <= 0.9: the first sentence only
            reply = dialect.error(f"The lora adapter '{fields['lora_name']}' has already been loaded.{hint}",
                                  "InvalidUserInput", 400)
        elif loadable is not None and fields["lora_path"] not in loadable:
            reply = dialect.error(f"Loading lora {fields['lora_name']} failed: No adapter found for "
                                  f"{fields['lora_path']}", "NotFoundError", 404)
        else:
            name = fields["lora_name"]
            self.engine.loras[name] = fields["lora_path"]
            await send_bytes(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                             headers=[(b"content-type", b"text/plain; charset=utf-8")])
            return
        await send_bytes(send, reply.status, reply.body)

    async def _unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM 0.32's runtime unload (`unload_lora_adapter`, `_check_unload_lora_adapter_request`): a
        missing name the validation error, an empty one 400 `InvalidUserInput`, an unknown one 404
        `NotFoundError`."""
        body = await _read_lora_request(self.engine, receive, send)
        if body is None:
            return
        fields = _lora_fields(body, ("lora_name",))
        dialect = self.engine.dialect
        if isinstance(fields, FieldValidationError):
            reply = dialect.validation_error(fields)
        elif not fields["lora_name"]:
            reply = dialect.error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput",
                                  400)
        elif fields["lora_name"] not in self.engine.loras:
            reply = dialect.error(f"The lora adapter '{fields['lora_name']}' cannot be found.", "NotFoundError", 404)
        else:
            name = fields["lora_name"]
            del self.engine.loras[name]
            await send_bytes(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                             headers=[(b"content-type", b"text/plain; charset=utf-8")])
            return
        await send_bytes(send, reply.status, reply.body)

    async def _sglang_load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's runtime load (python/sglang/srt/entrypoints/http_server.py `load_lora_adapter`: 200 or
        400 with a `LoRAUpdateOutput`). The checks in SGLang's order: LoRA off, then the
        `--max-loaded-loras` bound (both python/sglang/srt/managers/tokenizer_manager.py
        `load_lora_adapter`, whose ValueError leaves `loaded_adapters` null), then, in the scheduler,
        a name already loaded (python/sglang/srt/lora/lora_manager.py `validate_new_adapter`) and a
        path without an adapter: `LoRAConfig` hands a path that is no directory to huggingface_hub's
        `snapshot_download` (python/sglang/srt/lora/lora_config.py), whose repo-id check refuses an
        absolute path in the words below (huggingface_hub/utils/_validators.py `validate_repo_id`;
        the simulator says them for any path `lora_loadable_paths` lacks). The scheduler's answers
        carry every loaded adapter, name -> path (`LoRAManager.create_lora_update_result`)."""
        body = await _read_lora_request(self.engine, receive, send)
        if body is None:
            return
        name, path, config = body.get("lora_name"), body.get("lora_path"), self.engine.config
        loras = self.engine.loras
        if not isinstance(name, str) or not isinstance(path, str):
            reply = self.engine.dialect.bad_request("lora_name and lora_path must be strings.")
            await send_bytes(send, reply.status, reply.body)
            return
        if not config.lora_enabled:
            failure: tuple[str, dict[str, str] | None] | None = (
                "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None)
        elif config.max_loaded_loras is not None and len(loras) >= config.max_loaded_loras:
            failure = (f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded LoRA adapters "
                       f"is {config.max_loaded_loras}. Please unload some LoRA adapters before loading new ones.",
                       None)
        elif name in loras:
            failure = (f"Failed to load LoRA adapter {name} because it is already loaded", dict(loras))
        elif config.lora_loadable_paths is not None and path not in config.lora_loadable_paths:
            failure = (f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                       "Use `repo_type` argument if needed.", dict(loras))
        else:
            loras[name] = path
            failure = None
        if failure is None:
            await send_json(send, 200, _sglang_lora_update(True, "", dict(loras)))
        else:
            await send_json(send, 400, _sglang_lora_update(False, *failure))

    async def _sglang_unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """SGLang's runtime unload (`unload_lora_adapter` in the same files): an unknown name refused by
        its registry (python/sglang/srt/lora/lora_registry.py `unregister`, the names printed as the
        `dict_keys` they are). SGLang unloads only once the adapter's running requests finished
        (`wait_for_unload`); the simulator's requests hold no adapter, so it unloads at once."""
        body = await _read_lora_request(self.engine, receive, send)
        if body is None:
            return
        name, loras = body.get("lora_name"), self.engine.loras
        if not self.engine.config.lora_enabled:
            await send_json(send, 400, _sglang_lora_update(
                False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None))
        elif not isinstance(name, str) or name not in loras:
            await send_json(send, 400, _sglang_lora_update(
                False, f"LoRA with name {name} does not exist. Loaded LoRAs: {loras.keys()}", None))
        else:
            del loras[name]
            await send_json(send, 200, _sglang_lora_update(True, "", dict(loras)))

    async def _get_script(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.engine.script.model_dump())

    async def _set_script(self, scope: Scope, receive: Receive, send: Send) -> None:
        script = await _read_model(SimScript, receive, send)
        if script is not None:
            self.engine.script = script
            await send_json(send, 200, script.model_dump())


async def _read_model(model: type[_Body], receive: Receive, send: Send) -> _Body | None:
    """The request body as `model` (an empty body is `{}`); None when the client left or the body is
    not a valid one (then answered 422 with pydantic's message)."""
    raw = await read_body(receive)
    if raw is None:
        return None
    try:
        return model.model_validate(orjson.loads(raw or b"{}"))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        await send_json(send, 422, {"detail": str(exc)})
        return None


_Body = TypeVar("_Body", bound=BaseModel)


def create_sim_app(config: SimConfig) -> SimApp:
    """A fresh simulated engine (own state, own metrics registry) wrapped in its ASGI app."""
    return SimApp(SimWorkerState(config))


def _sglang_lora_update(success: bool, error_message: str, loaded: dict[str, str] | None) -> dict[str, Any]:
    """SGLang's `LoRAUpdateOutput` as its API server serializes the dataclass: the `BaseReq` fields
    first (python/sglang/srt/managers/io_struct.py)."""
    return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error_message,
            "loaded_adapters": loaded}


def _lora_fields(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, str] | FieldValidationError:
    """The required string fields of a vLLM LoRA request, or pydantic's errors for them as FastAPI
    reports a body (`loc` "body", field): "Field required" for a missing one, "Input should be a valid
    string" for another type."""
    errors: list[dict[str, Any]] = []
    for name in names:
        if name not in body:
            errors.append({"type": "missing", "loc": ("body", name), "msg": "Field required", "input": body})
        elif not isinstance(body[name], str):
            errors.append({"type": "string_type", "loc": ("body", name), "msg": "Input should be a valid string",
                           "input": body[name]})
    return FieldValidationError(errors) if errors else {name: body[name] for name in names}


async def _read_lora_request(engine: SimWorkerState, receive: Receive, send: Send) -> dict[str, Any] | None:
    """A runtime LoRA request's JSON object, or None after answering a 400 for another body."""
    raw = await read_body(receive)
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        reply = engine.dialect.bad_request("Invalid JSON body.")
        await send_bytes(send, reply.status, reply.body)
        return None
    return body
