"""Serve simulated engines: blocking (`run_sim`, for `kimi-gateway sim`), in a thread for tests
(`sim_server`), or as a uvicorn server to combine with others in one loop (`sim_uvicorn_server`).

`sim_server` and `sim_uvicorn_server` take a `SimConfig`, or `SimConfig` fields as keyword
arguments, or both (the fields then override the config's). A benchmark can run N workers in one
process::

    servers = [sim_uvicorn_server(engine="vllm", max_context_tokens=131072, port=9000 + i,
                                  kv_capacity_tokens=400_000, prefill_tokens_per_s=20_000,
                                  keep_records=False) for i in range(8)]
    asyncio.run(gateway.serving.server.serve_many(servers))
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from gateway.serving.server import QuietServer, ThreadedServer, serve_many, uvicorn_config
from gateway.sim.app import create_sim_app
from gateway.sim.config import ApiKeyScope, ApiVersion, SimConfig, SimEngineKind, SimFaults
from gateway.sim.keepalive import sim_http_options

DEFAULT_MAX_CONTEXT_TOKENS = 131_072


def build_sim_config(config: SimConfig | None = None, **fields: Any) -> SimConfig:
    """`config` with `fields` replaced, or a config made of `fields` alone; validated either way
    (unknown or invalid fields raise pydantic's ValidationError)."""
    if config is None:
        return SimConfig.model_validate(fields)
    if not fields:
        return config
    return SimConfig.model_validate({**config.model_dump(), **fields})


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SimConfig fields, uvicorn settings) of mixed keyword arguments."""
    sim = {k: v for k, v in kwargs.items() if k in SimConfig.model_fields}
    return sim, {k: v for k, v in kwargs.items() if k not in sim}


def sim_server(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0,
               **kwargs: Any) -> ThreadedServer:
    """A not-yet-started `ThreadedServer` running a fresh sim of `config` (port 0 = any free port).

    Keyword arguments that name `SimConfig` fields override `config`; the rest go to uvicorn.
    Use `with sim_server(cfg) as srv:` (or `.start()`); then `srv.url` is the base URL and
    `srv.app.engine` the `SimWorkerState` with the request records.
    """
    fields, uvicorn_kwargs = _split(kwargs)
    sim = build_sim_config(config, **fields)
    app = create_sim_app(sim)
    return ThreadedServer(app, host=host, port=port, **{**sim_http_options(sim, app.engine), **uvicorn_kwargs})


def sim_uvicorn_server(config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                       **kwargs: Any) -> QuietServer:
    """A uvicorn server for one sim, for `gateway.serving.server.serve_many` (the demo, benchmarks).

    Keyword arguments that name `SimConfig` fields override `config`; the rest go to uvicorn. The
    server leaves signal handling to its owner (`serve_many` stops every server on SIGINT/SIGTERM).
    """
    fields, uvicorn_kwargs = _split(kwargs)
    sim = build_sim_config(config, **fields)
    app = create_sim_app(sim)
    return QuietServer(uvicorn_config(app, host, port, **{**sim_http_options(sim, app.engine), **uvicorn_kwargs}))


def run_sim(
    engine: SimEngineKind | str,
    port: int,
    host: str = "127.0.0.1",
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
    ttft_s: float = 0.0,
    tpot_s: float = 0.0,
    served_model_names: list[str] | None = None,
    default_output_tokens: int | None = 16,
    bytes_per_token: float = 4.0,
    image_tokens: int = 256,
    max_num_seqs: int | None = None,
    api_version: ApiVersion | str = "current",
    faults: SimFaults | None = None,
    log_level: str = "info",
    *,
    kv_capacity_tokens: int | None = None,
    kv_block_tokens: int = 16,
    kv_usage_includes_cache: bool = False,
    prefill_tokens_per_s: float | None = None,
    decode_batch_slowdown: float = 0.0,
    keep_records: bool = True,
    api_key: str | None = None,
    api_key_scope: ApiKeyScope | str = "engine",
    keep_alive_s: float = 5.0,
    config: SimConfig | None = None,
    pd_role: str | None = None,
    pd_protocol: str | None = None,
    bootstrap_port: int | None = None,
    pd_wait_timeout_s: float = 300.0,
    kv_transfer_tokens_per_s: float | None = None,
    kv_load_failure_policy: str = "fail",
    scheduler: str = "per_request",
    chunk_tokens: int | None = None,
    decode_step_s: float | None = None,
    decode_s_per_seq: float | None = None,
    lora_modules: list[str] | None = None,
    pooling: bool = False,
) -> None:
    """Serve one simulated engine until interrupted (blocking; `kimi-gateway sim --engine ...`).

    `engine` is "vllm", "sglang" or "ascend"; invalid values raise pydantic's ValidationError.
    See `SimConfig` for the meaning and units of the other arguments (`chunk_tokens`,
    `decode_step_s`, `decode_s_per_seq`: None = the `SimConfig` default). With `config`, that config
    is served as it is and only `port`, `host` and `log_level` are read from the arguments. A
    SGLang or vLLM Mooncake prefill worker with a `bootstrap_port` also listens there, as their
    bootstrap servers do (see `gateway.sim.pd`).
    """
    if config is None:
        stepped = {name: value for name, value in (("chunk_tokens", chunk_tokens), ("decode_step_s", decode_step_s),
                                                   ("decode_s_per_seq", decode_s_per_seq)) if value is not None}
        config = SimConfig.model_validate({
            **stepped,
            "scheduler": scheduler,
            "engine": engine,
            "served_model_names": served_model_names or ["kimi-k3"],
            "lora_modules": lora_modules or [],
            "pooling": pooling,
            "max_context_tokens": max_context_tokens,
            "ttft_s": ttft_s,
            "tpot_s": tpot_s,
            "default_output_tokens": default_output_tokens,
            "bytes_per_token": bytes_per_token,
            "image_tokens": image_tokens,
            "max_num_seqs": max_num_seqs,
            "api_version": api_version,
            "faults": faults or SimFaults(),
            "kv_capacity_tokens": kv_capacity_tokens,
            "kv_block_tokens": kv_block_tokens,
            "kv_usage_includes_cache": kv_usage_includes_cache,
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "decode_batch_slowdown": decode_batch_slowdown,
            "keep_records": keep_records,
            "api_key": api_key,
            "api_key_scope": api_key_scope,
            "keep_alive_s": keep_alive_s,
            "pd_role": pd_role,
            "pd_protocol": pd_protocol,
            "bootstrap_port": bootstrap_port,
            "pd_wait_timeout_s": pd_wait_timeout_s,
            "kv_transfer_tokens_per_s": kv_transfer_tokens_per_s,
            "kv_load_failure_policy": kv_load_failure_policy,
        })
    app = create_sim_app(config)
    options = sim_http_options(config, app.engine)
    if config.bootstrap_port is not None and config.pd_role == "prefill" and config.pd_protocol != "vllm-nixl":
        servers = [QuietServer(uvicorn_config(app, host, p, log_level=log_level, **options))
                   for p in (port, config.bootstrap_port)]
        asyncio.run(serve_many(servers))
        return
    uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level, **options)).run()
