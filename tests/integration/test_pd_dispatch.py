"""The gateway in front of prefill/decode (PD) sims: both legs per protocol, streamed and not,
the per-phase headers, metrics and worker roles, and the failure semantics of issue 13 item 4."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.config import SimFaults
from tests.integration.pd_support import ENGINE, WEDGE_PROBES, StartSim, pd_group
from tests.support import RunningGateway, free_port, pool

StartGateway = Callable[..., RunningGateway]
MODES = ["sglang", "vllm-nixl", "vllm-mooncake"]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there, prefill and decode"}],
        "max_tokens": 8}


def _sse_text(body: str) -> str:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(out)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_pd_request_uses_both_legs(start_sim: StartSim, start_gateway: StartGateway, mode: str,
                                   stream: bool) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-prefill-worker"] == "pd/0"
    assert response.headers["x-kimi-gateway-decode-worker"] == "pd/1"
    assert response.headers["x-kimi-gateway-route-reason"].startswith("prefill:")
    text = _sse_text(response.text) if stream else response.json()["choices"][0]["message"]["content"]
    assert text
    decode = group.decode[0].engine
    (d_rec,) = decode.wait_for(lambda: [r for r in decode.records if r.completed])
    (p_rec,) = group.prefill[0].engine.records
    assert d_rec.pd_failure is None
    assert p_rec.headers["x-request-id"] == d_rec.headers["x-request-id"]
    if mode == "sglang":
        assert p_rec.body == d_rec.body and 0 <= d_rec.body["bootstrap_room"] < 2 ** 63
    else:
        assert p_rec.body["stream"] is False and p_rec.body["max_tokens"] == 1
        assert d_rec.body["kv_transfer_params"]["do_remote_prefill"] is True
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_pd_prefill_seconds_count{pool="pd"}') == 1
    assert gw.metric('kimi_gateway_pd_route_decisions_total{phase="decode"') == 1


def _rooms(records: list[Any]) -> list[int]:
    return [r.body["bootstrap_room"] for r in records]


@pytest.mark.parametrize("mode", MODES)
def test_prefill_failure_retries_on_another_prefill_worker(start_sim: StartSim, start_gateway: StartGateway,
                                                           mode: str) -> None:
    group = pd_group(start_sim, mode, prefill=2)
    group.prefill[0].engine.set_faults(SimFaults(**{"fail_status": 500}))
    gw = start_gateway([group.pool(disaggregation={"prefill_policy": "round_robin"})])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert response.headers["x-kimi-gateway-prefill-worker"] == "pd/1"
    failed, = group.prefill[0].engine.records
    served, = group.prefill[1].engine.records
    decode = group.decode[0].engine
    decodes = decode.wait_for(lambda: all(r.finished_at is not None for r in decode.records) and decode.records)
    assert decodes[-1].completed
    if mode == "sglang":  # the first decode leg (sent at once) was aborted, if it got out; rooms are never reused
        assert decodes[-1].body["bootstrap_room"] == served.body["bootstrap_room"] != failed.body["bootstrap_room"]
        assert all(d.aborted for d in decodes[:-1]) and len(decodes) <= 2
    elif mode == "vllm-nixl":  # the decode leg waits for the prefill answer: it never went out
        assert len(decodes) == 1
    else:
        assert failed.body["kv_transfer_params"]["transfer_id"] != served.body["kv_transfer_params"]["transfer_id"]
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_pd_leg_failures_total{outcome="status_5xx",phase="prefill"') == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_retries_on_another_decode_worker_with_a_fresh_prefill(
        start_sim: StartSim, start_gateway: StartGateway, mode: str, stream: bool) -> None:
    group = pd_group(start_sim, mode, decode=2)
    group.decode[0].engine.set_faults(SimFaults(**{"fail_status": 503}))
    gw = start_gateway([group.pool(disaggregation={"decode_policy": "round_robin"})])
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-decode-worker"] == "pd/2"
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    prefill = group.prefill[0].engine
    prefills = prefill.wait_for(lambda: all(r.finished_at is not None for r in prefill.records) and prefill.records)
    # A fresh prefill for the second decode worker (with both legs at once, the first prefill leg may
    # have been cancelled before it got out).
    assert len(prefills) == 2 if mode == "vllm-nixl" else len(prefills) in (1, 2)
    if mode == "sglang":
        assert len(set(_rooms(prefills))) == len(prefills)
        assert _rooms(prefills)[-1] == group.decode[1].engine.records[0].body["bootstrap_room"]
    gw.wait_until_idle()


@pytest.mark.parametrize("mode", MODES)
def test_client_disconnect_aborts_both_legs(start_sim: StartSim, start_gateway: StartGateway, mode: str) -> None:
    group = pd_group(start_sim, mode, tpot_s=0.05)
    gw = start_gateway([group.pool()])
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True, "max_tokens": 500},
                      timeout=10) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # the first content is out: both legs are running or done
    decode = group.decode[0].engine
    decode.wait_for(lambda: decode.records[0].finished_at is not None)
    assert decode.records[0].aborted
    prefill = group.prefill[0].engine
    prefill.wait_for(lambda: prefill.records[0].finished_at is not None)  # finished or aborted: none left running
    gw.wait_until_idle()
    assert gw.metric("kimi_gateway_in_flight{") == 0


@pytest.mark.parametrize(("mode", "prefill_hangs"), [("sglang", "before headers"), ("vllm-mooncake", "before headers"),
                                                     ("sglang", "after headers")])
def test_decode_whose_prefill_partner_dies_gets_a_clean_sse_error(start_sim: StartSim, start_gateway: StartGateway,
                                                                  mode: str, prefill_hangs: str) -> None:
    """The stream was committed (keep-alives) while the decode worker waited for KV; its prefill
    worker then fails its health probe: the decode leg is aborted and the client gets one SSE error.
    The prefill leg hangs before its answer's headers, or after them (a streamed SGLang prefill leg
    gets its headers at once and its first token after the prefill, here 30 s)."""
    group = pd_group(start_sim, mode, prefill=0)
    group.prefill = [start_sim(ENGINE[mode], pd_role="prefill", pd_protocol=mode,
                               ttft_s=30.0 if prefill_hangs == "after headers" else 0.0)]
    if prefill_hangs == "before headers":
        group.prefill[0].engine.set_faults(SimFaults(**{"hang_before_headers": True}))
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.2, "keepalive_interval": 0.1},
                       health=WEDGE_PROBES)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        assert next(chunks)  # committed: the held role event or a keep-alive
        group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True, black_hole=True))
        rest = b"".join(chunks)
    assert b'"error"' in rest and b"[DONE]" not in rest
    decode = group.decode[0].engine
    decode.wait_for(lambda: decode.records[0].finished_at is not None)
    assert decode.records[0].aborted
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_pd_leg_failures_total{outcome="moved",phase="prefill"') == 1


def test_pd_pool_in_a_mixed_context_chain(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """aggregated (small) -> PD (mid) -> aggregated (large): context-length routing picks the PD pool
    for a prompt only it fits, and a PD pool without a live prefill worker spills over."""
    small, large = start_sim("vllm"), start_sim("vllm")
    group = pd_group(start_sim, "vllm-nixl")
    dead = f"http://127.0.0.1:{free_port()}"
    pools = [pool("small", "vllm", [small.url], 300), group.pool("pd", 8000),
             pool("large", "vllm", [large.url], 100000)]
    gw = start_gateway(pools)
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "many words here " * 250}]}
    short = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert short.headers["x-kimi-gateway-pool"] == "small"
    mid = httpx.post(gw.v1 + "/chat/completions", json=long_chat, timeout=10)
    assert mid.status_code == 200 and mid.headers["x-kimi-gateway-pool"] == "pd"
    assert mid.headers["x-kimi-gateway-prefill-worker"] == "pd/0"
    # The same chain with the PD pool's only prefill worker dead: the request goes on to `large`.
    broken = group.pool("pd", 8000)
    broken["disaggregation"]["prefill"] = [{"url": dead}]
    gw2 = start_gateway([pools[0], broken, pools[2]])
    spilled = httpx.post(gw2.v1 + "/chat/completions", json=long_chat, timeout=10)
    assert spilled.status_code == 200, spilled.text
    assert spilled.headers["x-kimi-gateway-pool"] == "large"
    assert "x-kimi-gateway-prefill-worker" not in spilled.headers


def test_access_log_names_both_workers(start_sim: StartSim, start_gateway: StartGateway,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    group = pd_group(start_sim, "sglang")
    gw = start_gateway([group.pool()])
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200
    deadline = time.monotonic() + 5
    while not (lines := [orjson.loads(r.getMessage()) for r in caplog.records
                         if r.name == "gateway.access" and r.threadName == gw.server.thread_name]):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.02)
    assert (lines[0]["worker"], lines[0]["prefill_worker"]) == ("pd/1", "pd/0")


def test_roles_in_admin_workers_and_per_role_limits(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "sglang", prefill=1, decode=2, tpot_s=0.05)
    gw = start_gateway([group.pool(max_in_flight_per_worker=5, queue_timeout=0.0, spillover=False,
                                   disaggregation={"prefill_max_in_flight_per_worker": 1})])
    pd, = httpx.get(gw.url + "/admin/workers").json()["pools"]
    assert pd["disaggregation"] == {"mode": "sglang", "prefill_policy": "prefix_affinity",
                                    "decode_policy": "least_load"}
    assert [(w["id"], w["role"]) for w in pd["workers"]] == [("pd/0", "prefill"), ("pd/1", "decode"),
                                                              ("pd/2", "decode")]
    assert gw.metric('kimi_gateway_worker_role{pool="pd",role="decode"') == 2
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True, "max_tokens": 200},
                      timeout=10) as first:
        assert first.status_code == 200
        # The only prefill worker holds its one slot: a second request finds no room (no queue wait).
        second = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "server_overloaded"
    gw.wait_until_idle()
    third = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert third.status_code == 200


def test_a_failing_prefill_worker_is_ejected_in_its_role(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl", prefill=2)
    group.prefill[0].engine.set_faults(SimFaults(fail_status=500))
    gw = start_gateway([group.pool(disaggregation={"prefill_policy": "round_robin"})],
                       health={"passive_failures": 1, "ejection_base": 30})
    first = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert first.status_code == 200 and first.headers["x-kimi-gateway-attempts"] == "2"
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    roles = {w["id"]: (w["role"], w["state"]) for w in workers}
    assert roles == {"pd/0": ("prefill", "ejected"), "pd/1": ("prefill", "healthy"), "pd/2": ("decode", "healthy")}
    for _ in range(3):  # the ejected prefill worker gets no more legs; the decode worker was never blamed
        again = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert again.headers["x-kimi-gateway-attempts"] == "1"
        assert again.headers["x-kimi-gateway-prefill-worker"] == "pd/1"
    assert len(group.prefill[0].engine.records) == 1


def test_prefix_affinity_keeps_a_conversation_on_its_prefill_worker(start_sim: StartSim,
                                                                    start_gateway: StartGateway) -> None:
    """The prefix cache lives on the prefill workers: turn 2 of a conversation goes to the prefill
    worker that prefilled turn 1 (which then finds the prefix in its cache)."""
    group = pd_group(start_sim, "sglang", prefill=3, kv_capacity_tokens=200000)
    gw = start_gateway([group.pool()], load={"enabled": False})
    for n in range(4):
        history = [{"role": "user", "content": f"conversation {n}: " + "tell me about the sea and ships " * 200}]
        first = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "messages": history}, timeout=10)
        history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and then?"}]
        second = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "messages": history}, timeout=10)
        assert second.headers["x-kimi-gateway-prefill-worker"] == first.headers["x-kimi-gateway-prefill-worker"]
        assert second.headers["x-kimi-gateway-route-reason"].startswith("prefill:affinity,decode:")
        prefill = group.prefill[int(first.headers["x-kimi-gateway-prefill-worker"].split("/")[1])].engine
        assert prefill.records[-1].cached_tokens > 0


def test_nixl_prefill_longer_than_the_hold_window_commits_with_keepalives(start_sim: StartSim,
                                                                          start_gateway: StartGateway) -> None:
    """A vLLM NIXL prefill leg is not streamed: when it outlasts `hold_headers` the client's stream
    is committed and kept alive while it runs (as for an aggregated engine's long prefill), then the
    decode leg's tokens follow."""
    group = pd_group(start_sim, "vllm-nixl", prefill=0)
    group.prefill = [start_sim("vllm", pd_role="prefill", pd_protocol="vllm-nixl", ttft_s=0.6)]
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.1, "keepalive_interval": 0.1})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_bytes())
    assert body.startswith(b": keep-alive\n\n")
    assert _sse_text(body.decode()) and body.rstrip().endswith(b"data: [DONE]")
    (d_rec,) = group.decode[0].engine.records
    assert d_rec.completed and d_rec.body["kv_transfer_params"]["do_remote_prefill"] is True
    gw.wait_until_idle()
    assert gw.metric('kimi_gateway_pd_prefill_seconds_count{pool="pd"}') == 1


def test_nixl_deferred_stream_whose_prefill_fails_ends_with_one_sse_error(start_sim: StartSim,
                                                                         start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl", prefill=0)
    group.prefill = [start_sim("vllm", pd_role="prefill", pd_protocol="vllm-nixl",
                               faults={"hang_before_headers": True})]
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.1, "keepalive_interval": 0.1},
                       health=WEDGE_PROBES)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        assert next(chunks).startswith(b": keep-alive")
        group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True, black_hole=True))
        rest = b"".join(chunks)
    assert rest.count(b'"error"') == 1 and b"[DONE]" not in rest
    assert group.decode[0].engine.records == []  # the decode leg never went out
    gw.wait_until_idle()


def test_anthropic_messages_skip_the_pd_pool(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl")
    aggregated = start_sim("vllm")
    gw = start_gateway([group.pool("pd", 131072), pool("agg", "vllm", [aggregated.url], 131072)])
    answer = httpx.post(gw.url + "/v1/messages", json={"model": "kimi-k3", "max_tokens": 8,
                                                       "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kimi-gateway-pool"] == "agg"
    assert "pd" in answer.headers.get("x-kimi-gateway-skipped-pools", "")
    assert group.decode[0].engine.records == [] and group.prefill[0].engine.records == []


def test_mooncake_prefill_whose_bootstrap_server_is_down_is_passed_over(start_sim: StartSim,
                                                                        start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-mooncake", prefill=2)
    config = group.pool(disaggregation={"prefill_policy": "round_robin"})
    config["disaggregation"]["prefill"][0]["bootstrap_port"] = free_port()  # nothing listens there
    gw = start_gateway([config])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-prefill-worker"] == "pd/1"
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    assert group.prefill[0].engine.records == []  # no leg went out without the engine id
    (d_rec,) = group.decode[0].engine.records
    assert d_rec.body["kv_transfer_params"]["remote_engine_id"] == group.prefill[1].engine.pd.engine_id


@pytest.mark.parametrize("mode", MODES)
def test_client_gone_during_the_prefill_aborts_every_leg(start_sim: StartSim, start_gateway: StartGateway,
                                                         mode: str) -> None:
    """The client hangs up while the prefill still runs (nothing sent yet): no leg is left running."""
    group = pd_group(start_sim, mode, prefill=0)
    group.prefill = [start_sim(ENGINE[mode], pd_role="prefill", pd_protocol=mode, ttft_s=3.0)]
    gw = start_gateway([group.pool()])
    prefill, decode = group.prefill[0].engine, group.decode[0].engine
    body = orjson.dumps({**CHAT, "stream": True})
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                       b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        prefill.wait_for(lambda: prefill.records)  # the prefill leg is running (and, but for NIXL, the decode leg)
        if mode != "vllm-nixl":
            decode.wait_for(lambda: decode.records)
    records = prefill.wait_for(lambda: all(r.finished_at is not None for r in prefill.records) and prefill.records)
    assert [r.aborted for r in records] == [True]
    decode.wait_for(lambda: all(r.finished_at is not None for r in decode.records))
    assert all(r.aborted for r in decode.records)  # SGLang / Mooncake: sent at once, aborted too
    assert (len(decode.records) == 0) == (mode == "vllm-nixl")
    gw.wait_until_idle()
