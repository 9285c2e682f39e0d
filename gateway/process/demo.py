"""`kimi-gateway demo`: one simulated engine per worker URL of a config, and the gateway, in one process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any
from urllib.parse import urlsplit

from gateway.app import create_app
from gateway.backends.pool_params import PoolConfig
from gateway.config import GatewayConfig
from gateway.dialects.names import POOLING_APIS
from gateway.process.supervisor import bind_socket
from gateway.serving.request_head import http_options
from gateway.serving.server import QuietServer, serve_many, uvicorn_config
from gateway.sim.app import create_sim_app
from gateway.sim.config import SimConfig

DEMO_TTFT_S = 0.15
DEMO_TPOT_S = 0.02


def demo_servers(config: GatewayConfig, host: str, port: int) -> list[QuietServer]:
    """uvicorn servers for every simulated worker (at its configured loopback port), then the gateway
    (last: `serve_many(..., last_depends_on_others=True)` starts it once the workers listen and stops
    it before them)."""
    servers = []
    served = config.pool_served_names()
    for pool in config.pools:
        if pool.engine == "llamacpp":
            raise SystemExit(f"demo: pool {pool.name} is a llama.cpp pool; start it with `kimi-gateway engine`")
        for url in pool.workers:
            parts = urlsplit(url)
            if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
                raise SystemExit(f"demo: worker {url} must be a loopback URL with a port")
            sim = SimConfig(engine=pool.engine, max_context_tokens=pool.max_context_tokens,
                            served_model_names=list(served[pool.name]),
                            ttft_s=DEMO_TTFT_S, tpot_s=DEMO_TPOT_S, default_output_tokens=40,
                            **_serves(pool))
            servers.append(QuietServer(uvicorn_config(create_sim_app(sim), "127.0.0.1", parts.port)))
    servers.append(QuietServer(uvicorn_config(create_app(config), host, port, **http_options(config))))
    return servers


def _serves(pool: PoolConfig) -> dict[str, Any]:
    """What the simulated workers of `pool` serve besides generation: the pooling APIs when its
    `apis` are pooling APIs only (an embedding model), its declared LoRA adapters (loaded at start,
    at a made-up path) and runtime loading when it loads adapters on demand."""
    pooling = pool.apis is not None and bool(pool.apis) and set(pool.apis) <= POOLING_APIS
    return {"pooling": pooling, "lora_modules": [f"{name}=/loras/{name}" for name in pool.lora_adapters],
            "runtime_lora_updating": bool(pool.lora_on_demand)}


def run_demo(config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the demo until Ctrl-C, after printing how to try it. Exits (SystemExit, status 1) when
    a port it needs is in use."""
    servers = demo_servers(config, host, port)
    sockets = listen_or_exit(servers)
    url = f"http://{host}:{port}"
    print(f"kimi-gateway demo: {sum(len(p.workers) for p in config.pools)} simulated workers in "
          f"{len(config.pools)} pools ({', '.join(p.name for p in config.pools)}); gateway on {url}")
    print("Try:")
    model = config.served_models()[0].name
    print(f"  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"stream\": true, \"messages\": [{{\"role\": \"user\", "
          "\"content\": \"Hello!\"}]}'")
    print(f"  curl -s {url}/v1/models; curl -s {url}/ready; curl -s {url}/metrics | grep kimi_gateway_requests")
    print("Ctrl-C stops it.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_many(servers, last_depends_on_others=True, sockets=sockets))


def listen_or_exit(servers: list[QuietServer]) -> list[socket.socket]:
    """A bound listening socket per server, before anything starts; a port in use ends the demo
    with one line and status 1 (as `serve` does), not with uvicorn's tracebacks."""
    sockets: list[socket.socket] = []
    for server in servers:
        host, port = server.config.host, server.config.port
        try:
            sockets.append(bind_socket(host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            raise SystemExit(f"demo: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets
