"""The gateway's half of the PD wire check (issue 13 item 6), and the OpenAI SDK end to end.

The same requests the peer test (tests/integration/sim/test_sim_pd_peers.py) sends through
sglang-router and vllm-router go through the gateway, with the OpenAI SDK as the client, to PD
sims; the legs the sims received must carry the protocol's fields in the same places, with the
same JSON types and the same protocol constants, as the peers' recorded legs
(tests/integration/sim/pd_wire_shapes.json). Only protocol paths are compared: the
`bootstrap_*` fields, `kv_transfer_params.*`, the shared `x-request-id`, and what a vLLM prefill
leg rewrites (`stream`, `max_tokens`, `stream_options`). The client's own fields (which name the
output limit goes by, `stream_options` on a decode leg) follow the client and the engine kind,
not the protocol. One known difference, on purpose: vllm-router 0.1.17 adds `min_tokens: 1` to
every prefill leg (newer vllm-routers only lower a client's above 1); the gateway leaves `min_tokens`
out of the prefill leg, which generates its one token either way.
The gateway's `x-request-id` (on every engine request, shared by both legs) is compared for the vLLM
protocols, which tie the legs by it; sglang-router sends none and SGLang ties the legs by the room.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from gateway.sim.pd_wire import pd_wire_constants, pd_wire_shape
from gateway.sim.tokens import output_text
from tests.integration.pd_support import StartSim, pd_group, send
from tests.support import RunningGateway

StartGateway = Callable[..., RunningGateway]
SHAPES = json.loads((Path(__file__).parent / "sim" / "pd_wire_shapes.json").read_text())
CASES = [(kind, stream) for kind in ("chat", "text") for stream in (False, True)]
VLLM_PREFILL_REWRITES = ("body.stream", "body.max_tokens", "body.stream_options")
KNOWN_DIFFERENCES = {"body.min_tokens"}


def protocol_paths(mode: str, leg: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The entries of `shape` (a wire shape or constants) that belong to the PD protocol."""
    def wanted(path: str) -> bool:
        if path in KNOWN_DIFFERENCES:
            return False
        if path.startswith("header."):  # the gateway sends its request id to every engine; vLLM's PD needs it
            return mode != "sglang"
        if path.startswith(("body.bootstrap_", "body.kv_transfer_params")):
            return True
        return mode != "sglang" and leg == "prefill" and path in VLLM_PREFILL_REWRITES

    return {path: value for path, value in shape.items() if wanted(path)}


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl", "vllm-mooncake"])
@pytest.mark.parametrize(("kind", "stream"), CASES)
def test_gateway_legs_match_the_peer_routers(start_sim: StartSim, start_gateway: StartGateway, mode: str,
                                             kind: str, stream: bool) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    text = send(gw.v1, kind, stream)
    assert text.split() == output_text(4).split()  # the decode worker's 4 tokens, through the SDK
    decode, prefill = group.decode[0].engine, group.prefill[0].engine
    (d_rec,) = decode.wait_for(lambda: [r for r in decode.records if r.completed])
    (p_rec,) = prefill.wait_for(lambda: [r for r in prefill.records if r.completed])
    assert d_rec.pd_failure is None and d_rec.kv_transfer_tokens > 0  # the KV came from the prefill sim
    reference = SHAPES[mode][f"{kind}/{'stream' if stream else 'json'}"]
    for leg, rec in (("prefill", p_rec), ("decode", d_rec)):
        expected = reference[leg]
        assert protocol_paths(mode, leg, pd_wire_shape(rec)) == protocol_paths(mode, leg, expected["shape"]), leg
        assert (protocol_paths(mode, leg, pd_wire_constants(rec))
                == protocol_paths(mode, leg, expected["constants"])), leg


def test_sglang_batch_of_prompts_gets_one_room_per_prompt(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "sglang")
    gw = start_gateway([group.pool()])
    client = OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=20)
    answer = client.completions.create(model="kimi-k3", prompt=["one prompt", "another prompt"], max_tokens=3)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    (p_rec,), (d_rec,) = group.prefill[0].engine.records, group.decode[0].engine.records
    assert p_rec.body == d_rec.body
    rooms = d_rec.body["bootstrap_room"]
    assert pd_wire_shape(d_rec)["body.bootstrap_room"] == "list[int]" and len(set(rooms)) == 2
    assert d_rec.body["bootstrap_host"] == ["127.0.0.1"] * 2
