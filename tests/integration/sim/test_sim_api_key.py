"""The simulator's `api_key` (as the engines' `--api-key` guards paths, or a proxy guarding all) and
its hostile probe bodies (`health_body` / `metrics_body`), over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
KEY = {"authorization": "Bearer sim-key-1"}


def statuses(srv: RunningSim, headers: dict[str, str]) -> dict[str, int]:
    with httpx.Client(base_url=srv.url, headers=headers) as client:
        return {path: client.get(path).status_code
                for path in ("/health", "/metrics", "/v1/models", "/get_model_info", "/sim/faults")}


def test_vllm_key_guards_the_openai_api_only(start_sim: StartSim) -> None:
    srv = start_sim(api_key="sim-key-1")
    assert statuses(srv, {}) == {"/health": 200, "/metrics": 200, "/v1/models": 401, "/get_model_info": 404,
                                 "/sim/faults": 200}
    assert httpx.get(srv.url + "/v1/models").json() == {"error": "Unauthorized"}
    assert statuses(srv, KEY)["/v1/models"] == 200
    assert statuses(srv, {"authorization": "Bearer sim-key-2"})["/v1/models"] == 401
    assert httpx.options(srv.url + "/v1/models").status_code != 401


def test_sglang_key_guards_all_but_health_and_metrics(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", api_key="sim-key-1")
    assert statuses(srv, {}) == {"/health": 200, "/metrics": 200, "/v1/models": 401, "/get_model_info": 401,
                                 "/sim/faults": 200}
    assert statuses(srv, KEY)["/get_model_info"] == 200  # SGLang serves it (the deprecated `/model_info` alias)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_scope_all_guards_every_path_like_a_proxy(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine=engine, api_key="sim-key-1", api_key_scope="all")
    assert statuses(srv, {}) == {"/health": 401, "/metrics": 401, "/v1/models": 401, "/get_model_info": 401,
                                 "/sim/faults": 200}
    assert statuses(srv, KEY) == {"/health": 200, "/metrics": 200, "/v1/models": 200,
                                  "/get_model_info": 200 if engine == "sglang" else 404, "/sim/faults": 200}


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_trickling_body_sends_a_byte_at_a_time_and_never_ends(start_sim: StartSim, path: str) -> None:
    field = "health_body" if path == "/health" else "metrics_body"
    srv = start_sim(faults={field: "trickle", "trickle_interval_s": 0.02})
    received = b""
    with httpx.stream("GET", srv.url + path, timeout=5) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            received += chunk
            if len(received) >= 5:
                break
    assert received == b"#####"


def test_endless_body_streams_until_the_client_leaves(start_sim: StartSim) -> None:
    srv = start_sim(faults={"metrics_body": "endless"})
    received = 0
    with httpx.stream("GET", srv.url + "/metrics", timeout=5) as response:
        for chunk in response.iter_raw():
            received += len(chunk)
            if received > 4 << 20:
                break
    assert received > 4 << 20
    deadline = time.monotonic() + 5  # the sim notices the client left and stays usable
    while httpx.post(srv.url + "/sim/faults", json={}).status_code != 200:
        assert time.monotonic() < deadline
    assert b"vllm:num_requests_running" in httpx.get(srv.url + "/metrics").content
