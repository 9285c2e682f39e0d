"""Test support: handles of running servers and small config builders."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from gateway.server import ThreadedServer
from gateway.sim.engine import SimEngine

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("KIMI_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@dataclass
class RunningSim:
    """A simulated engine on a loopback port."""

    server: ThreadedServer
    engine: SimEngine

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class RunningGateway:
    """A gateway on a loopback port and the config it runs."""

    server: ThreadedServer
    config: GatewayConfig

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def v1(self) -> str:
        return self.server.url + "/v1"


def pool(name: str, engine: str, urls: list[str], max_context_tokens: int, **extra: Any) -> dict[str, Any]:
    """A pool config mapping for tests."""
    return {"name": name, "engine": engine, "workers": urls, "max_context_tokens": max_context_tokens, **extra}
