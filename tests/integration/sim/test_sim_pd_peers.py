"""The peers' own PD routers in front of the simulator's PD roles: sglang-router
(`launch_router --pd-disaggregation`) and vllm-router (`--vllm-pd-disaggregation`, with
`--kv-connector nixl` and `mooncake`).

The OpenAI SDK sends chat and completions requests, streamed and not, through each router; the
test checks that the sims accept the peer's traffic end to end (the decode worker received the KV
from the prefill worker) and that what the workers received matches the protocol, field by field:
`pd_wire_shape` / `pd_wire_constants` of every leg against pd_wire_shapes.json (the reference a
gateway test can hold the gateway's own legs to). Skipped when the routers are not installed (the
`bench` extra; `.ci/run` installs them). With `KIMI_PD_WIRE_WRITE=1` the file is rewritten from
what the peers sent (review the diff before committing it).

Every request asks for `max_tokens=4` (streams also for `stream_options.include_usage`), so the
file's constants hold those client values where a router passes them through. Not protocol, but
recorded: sglang-router 0.3.2 re-encodes a chat request's `max_tokens` as `max_completion_tokens`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.serving.server import ThreadedServer
from gateway.sim import SimConfig, sim_server
from gateway.sim.pd_wire import pd_wire_constants, pd_wire_shape
from gateway.sim.tokens import output_text
from tests.integration.pd_support import send
from tests.support import free_port, stop_process, wait_router_healthy

SHAPES_FILE = Path(__file__).with_name("pd_wire_shapes.json")
CASES = [(kind, stream) for kind in ("chat", "text") for stream in (False, True)]


@dataclass
class PeerPair:
    """One prefill sim, one decode sim and a peer router in front of them."""

    protocol: str
    router_url: str
    prefill: ThreadedServer
    decode: ThreadedServer
    proc: subprocess.Popen[bytes]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _router_command(protocol: str, prefill: str, decode: str, port: int) -> list[str]:
    # Both routers serve Prometheus on 29000 by default: a free port each, so runs never collide.
    common = ["--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--worker-startup-check-interval",
              "1", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    prefill_port = prefill.rsplit(":", 1)[1]  # the sim answers the bootstrap calls on its HTTP port
    if protocol == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill, prefill_port, *common]
    if protocol == "vllm-mooncake":
        return [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector",
                "mooncake", "--prefill", prefill, prefill_port, *common]
    return [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", prefill, *common]




def _start_pair(protocol: str, log: Path) -> PeerPair:
    engine = "sglang" if protocol == "sglang" else "vllm"
    # The prefill worker keeps a prefix cache; the decode worker none, so every request pulls its KV.
    # SGLang's /health (a one-token generation polled once a second) at a 0.05 s poll: the router marks
    # the workers healthy at its first checks, so its first request finds them (the wire is checked, not that wait)
    sims = [sim_server(SimConfig(engine=engine, max_context_tokens=32_768, pd_role=role, pd_protocol=protocol,
                                 kv_capacity_tokens=100_000 if role == "prefill" else None,
                                 pd_wait_timeout_s=10.0, health_generate_poll_s=0.05)).start()
            for role in ("prefill", "decode")]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "HTTP_PROXY", "HTTPS_PROXY")}
    proc = subprocess.Popen(_router_command(protocol, sims[0].url, sims[1].url, port), env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_router_healthy(proc, url, log, f"{protocol} router")
    except BaseException:
        stop_process(proc)
        for sim in sims:
            sim.stop()
        raise
    return PeerPair(protocol, url, sims[0], sims[1], proc)


@pytest.fixture(scope="module", params=["sglang", "vllm-nixl", "vllm-mooncake"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerPair]:
    module = "sglang_router" if request.param == "sglang" else "vllm_router"
    if not _installed(module):
        if os.environ.get("CI"):  # .ci/run installs the peers: there a skipped wire check proves nothing
            raise RuntimeError(f"{module} is not installed; .ci/run must install it")
        pytest.skip(f"{module} not installed (pip install -c constraints.txt sglang-router vllm-router)")
    running = _start_pair(request.param, tmp_path_factory.mktemp("peer") / "router.log")
    yield running
    stop_process(running.proc)
    running.prefill.stop()
    running.decode.stop()


def _records(server: ThreadedServer) -> list[Any]:
    return server.app.engine.records  # type: ignore[attr-defined, no-any-return]


def _reference() -> dict[str, Any]:
    return json.loads(SHAPES_FILE.read_text()) if SHAPES_FILE.exists() else {}


@pytest.mark.parametrize(("kind", "stream"), CASES)
def test_peer_router_traffic_is_accepted_and_matches_the_protocol(pair: PeerPair, kind: str, stream: bool) -> None:
    for server in (pair.prefill, pair.decode):
        server.app.engine.clear_records()  # type: ignore[attr-defined]
    text = send(pair.router_url + "/v1", kind, stream)
    assert text.split() == output_text(4).split()  # the 4 tokens of the decode worker

    decode_done = pair.decode.app.engine.wait_for(  # type: ignore[attr-defined]
        lambda: [r for r in _records(pair.decode) if r.completed], timeout=5)
    prefill_done = pair.prefill.app.engine.wait_for(  # type: ignore[attr-defined]
        lambda: [r for r in _records(pair.prefill) if r.completed], timeout=5)
    (p_rec,), (d_rec,) = prefill_done, decode_done
    assert p_rec.status == d_rec.status == 200
    assert d_rec.pd_failure is None and d_rec.kv_transfer_tokens > 0  # the KV came from the prefill sim
    if pair.protocol == "sglang":
        assert p_rec.body == d_rec.body  # the same body to both workers
    else:
        assert p_rec.headers["x-request-id"] == d_rec.headers["x-request-id"]
        assert d_rec.body["kv_transfer_params"]["remote_engine_id"] == pair.prefill.app.engine.pd.engine_id  # type: ignore[attr-defined]
    if pair.protocol == "vllm-mooncake":  # one transfer id, minted by the router, on both legs
        assert p_rec.body["kv_transfer_params"]["transfer_id"] == d_rec.body["kv_transfer_params"]["transfer_id"]

    observed = {leg: {"shape": pd_wire_shape(rec), "constants": pd_wire_constants(rec)}
                for leg, rec in (("prefill", p_rec), ("decode", d_rec))}
    key = f"{kind}/{'stream' if stream else 'json'}"
    if os.environ.get("KIMI_PD_WIRE_WRITE") == "1":
        reference = _reference()
        reference.setdefault(pair.protocol, {})[key] = observed
        SHAPES_FILE.write_text(json.dumps(reference, indent=2, sort_keys=True) + "\n")
    assert observed == _reference()[pair.protocol][key]
