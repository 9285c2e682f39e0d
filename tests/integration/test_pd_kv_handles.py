"""A vLLM NIXL prefill worker's KV handle is checked before it reaches a decode worker (issue 25 §6):
the decode worker reads the blocks from the handle's `remote_host:remote_port`, so a prefill worker
handing out a handle that names another host (or, when configured, another port) than its own
fails the attempt against the prefill worker: a clean OpenAI error, nothing sent to the decode
worker, no lease left open, the failure counted against the prefill worker."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.integration.pd_support import PROMPT, StartSim, pd_group
from tests.support import RunningGateway

StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}


def _refused(gw: RunningGateway, stream: bool) -> str:
    """The gateway's answer to one request, which must fail: its error message."""
    answer = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    if answer.status_code == 200:  # a committed stream ends with one error event
        assert stream and answer.text.startswith(": keep-alive"), answer.text
        assert answer.text.count('"error"') == 1 and "[DONE]" not in answer.text, answer.text
        return answer.text
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return str(error["message"])


@pytest.mark.parametrize(("stream", "deferred"), [(False, False), (True, False), (True, True)])
def test_a_handle_naming_another_host_never_reaches_the_decode_worker(start_sim: StartSim,
                                                                       start_gateway: StartGateway,
                                                                       stream: bool, deferred: bool) -> None:
    """`deferred`: the prefill leg outlasts `hold_headers`, so the stream is committed (keep-alives)
    before the handle comes: it ends with one SSE error event instead of a 502."""
    group = pd_group(start_sim, "vllm-nixl", ttft_s=0.4 if deferred else 0.0)
    hostile = group.prefill[0].engine
    hostile.config.side_channel_host = "127.0.0.2"  # a host that is not this prefill worker's
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.1 if deferred else 5.0, "keepalive_interval": 0.1})
    message = _refused(gw, stream)
    assert "127.0.0.2" in message or deferred
    assert group.decode[0].engine.records == []  # the decode worker never saw the handle
    assert hostile.records, "the prefill leg was sent"
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_pd_leg_failures_total{outcome="protocol_error",phase="prefill",pool="pd"}') >= 1
    # the prefill worker (pd/0) is charged, not the decode worker
    prefill, decode = gw.server.app.state.gateway.registry.pools["pd"]
    assert prefill.role == "prefill" and "remote_host '127.0.0.2'" in (prefill.last_error or "")
    assert decode.last_error is None and decode.consecutive_failures == 0
    if not deferred:  # a committed stream's attempt was accepted: its failure is the stream's
        assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="protocol_error",pool="pd",worker="pd/0"}') >= 1
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="protocol_error",pool="pd",worker="pd/1"}') == 0


def test_a_configured_side_channel_is_what_a_handle_must_name(start_sim: StartSim,
                                                             start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl")
    engine = group.prefill[0].engine
    port = int(group.prefill[0].url.rsplit(":", 1)[1])  # the sim's handles name its HTTP port
    engine.config.side_channel_host = "localhost"
    config = group.pool()
    config["disaggregation"]["prefill"][0].update(side_channel_host="LOCALHOST", side_channel_port=port + 1)
    gw = start_gateway([config])
    assert "remote_port" in _refused(gw, False)  # the right host, another port
    assert group.decode[0].engine.records == []
    config["disaggregation"]["prefill"][0]["side_channel_port"] = port
    ok = start_gateway([config])
    answer = httpx.post(ok.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert answer.status_code == 200, answer.text
    [decode] = group.decode[0].engine.records
    assert decode.body["kv_transfer_params"]["remote_host"] == "localhost"
