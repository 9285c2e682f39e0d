"""Connector-steering fields the attack review found reaching workers (docs/security.md): vLLM's
`ec_transfer_params` (the encoder-cache connector's handle: the consumer opens a session to the
`peer_host`/`peer_port` it names and pulls cache from there; `vllm/entrypoints/openai/*/protocol.py`
copy it into `SamplingParams.extra_args`), and the same keys inside `vllm_xargs`, whose dict vLLM
takes as `extra_args` as it is before adding its own (so the KV connector reads a
`vllm_xargs.kv_transfer_params` when the top-level field is absent). Stripped unless the pool sets
`allow_kv_transfer_fields`; the client's other `vllm_xargs` reach the engine unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
EC = {"mm-hash-1": {"peer_host": "10.6.6.6", "peer_port": 5600, "size_bytes": 4096}}
HOSTILE = {"ec_transfer_params": EC,
           "vllm_xargs": {"kv_transfer_params": "10.6.6.6:5600", "ec_transfer_params": "10.6.6.6", "mine": 7}}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "completions": ("/completions", {"prompt": "hi", "max_tokens": 2}),
    "responses": ("/responses", {"input": "hi", "max_output_tokens": 2}),
}


@pytest.mark.parametrize("offload", [False, True])
def test_encoder_cache_handles_and_nested_connector_fields_never_reach_a_worker(
        start_sim: StartSim, start_gateway: StartGateway, offload: bool) -> None:
    sim = start_sim("vllm")
    settings = {"parse_offload_bytes": 1} if offload else {}  # also through a parse process's ForwardBody
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], **settings)
    for path, body in BODIES.values():
        answer = httpx.post(gw.v1 + path, json={"model": "kimi-k3", **body, **HOSTILE}, timeout=10)
        assert answer.status_code == 200, answer.text
    assert len(sim.engine.records) == len(BODIES)
    for record in sim.engine.records:
        assert "ec_transfer_params" not in record.body, (record.path, record.body)
        assert record.body["vllm_xargs"] == {"mine": 7}, (record.path, record.body)


def test_a_pool_allowing_the_kv_fields_gets_them_as_sent(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, allow_kv_transfer_fields=True)])
    path, body = BODIES["chat"]
    assert httpx.post(gw.v1 + path, json={"model": "kimi-k3", **body, **HOSTILE}, timeout=10).status_code == 200
    [record] = sim.engine.records
    assert {k: record.body[k] for k in HOSTILE} == HOSTILE
