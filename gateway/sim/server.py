"""Serve simulated engines: blocking (`run_sim`, for `kimi-gateway sim`), in a thread for tests
(`sim_server`), or as a uvicorn server to combine with others in one loop (`sim_uvicorn_server`).
"""

from __future__ import annotations

from typing import Any

import uvicorn

from gateway.server import ThreadedServer, uvicorn_config
from gateway.sim.app import create_sim_app
from gateway.sim.config import ApiVersion, Engine, SimConfig, SimFaults

DEFAULT_MAX_CONTEXT_TOKENS = 131_072


def sim_server(config: SimConfig, host: str = "127.0.0.1", port: int = 0, **uvicorn_kwargs: Any) -> ThreadedServer:
    """A not-yet-started `ThreadedServer` running a fresh sim of `config` (port 0 = any free port).

    Use `with sim_server(cfg) as srv:` (or `.start()`); then `srv.url` is the base URL and
    `srv.app.engine` the `SimEngine` with the request records.
    """
    return ThreadedServer(create_sim_app(config), host=host, port=port, **uvicorn_kwargs)


def sim_uvicorn_server(config: SimConfig, host: str = "127.0.0.1", port: int = 0,
                       **uvicorn_kwargs: Any) -> uvicorn.Server:
    """A uvicorn server for one sim, e.g. for `gateway.server.serve_many` (the demo)."""
    return uvicorn.Server(uvicorn_config(create_sim_app(config), host, port, **uvicorn_kwargs))


def run_sim(
    engine: Engine | str,
    port: int,
    host: str = "127.0.0.1",
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
    ttft_s: float = 0.0,
    tpot_s: float = 0.0,
    served_model_names: list[str] | None = None,
    default_output_tokens: int = 16,
    bytes_per_token: float = 4.0,
    image_tokens: int = 256,
    max_num_seqs: int | None = None,
    api_version: ApiVersion | str = "current",
    faults: SimFaults | None = None,
    log_level: str = "info",
) -> None:
    """Serve one simulated engine until interrupted (blocking; `kimi-gateway sim --engine ...`).

    `engine` is "vllm", "sglang" or "ascend"; invalid values raise pydantic's ValidationError.
    See `SimConfig` for the meaning and units of the other arguments.
    """
    config = SimConfig.model_validate({
        "engine": engine,
        "served_model_names": served_model_names or ["kimi-k3"],
        "max_context_tokens": max_context_tokens,
        "ttft_s": ttft_s,
        "tpot_s": tpot_s,
        "default_output_tokens": default_output_tokens,
        "bytes_per_token": bytes_per_token,
        "image_tokens": image_tokens,
        "max_num_seqs": max_num_seqs,
        "api_version": api_version,
        "faults": faults or SimFaults(),
    })
    sim_uvicorn_server(config, host, port, log_level=log_level).run()
