"""Failures in front of a prefill/decode (PD) pool and odd inputs to it (issue 13): garbage prefill
answers, dead legs, batches and n>1, token accounting; every answer an OpenAI-shaped error or a
clean stream, no leg left running, the in-flight gauges back to 0."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from gateway.config import parse_config
from gateway.serving.reload import apply_config
from gateway.sim.config import SimFaults
from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.integration.pd_support import ENGINE, WEDGE_PROBES, StartSim, pd_group
from tests.support import RunningGateway, free_port, pool

StartGateway = Callable[..., RunningGateway]
MODES = ["sglang", "vllm-nixl", "vllm-mooncake"]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hostile prefill and decode"}],
        "max_tokens": 8}


def _settled(group, gw: RunningGateway) -> None:  # type: ignore[no-untyped-def]
    for sim in group.all():
        engine = sim.engine
        engine.wait_for(lambda e=engine: all(r.finished_at is not None for r in e.records) or None)
    gw.wait_until_idle()
    assert gw.metric("kimi_gateway_in_flight{") == 0


@pytest.mark.parametrize("body", ["not json at all", "[1, 2]", "null"])
def test_nixl_prefill_answering_garbage_is_a_clean_502(start_sim: StartSim, start_gateway: StartGateway,
                                                       body: str) -> None:
    group = pd_group(start_sim, "vllm-nixl")
    group.prefill[0].engine.set_faults(SimFaults(fail_status=200, fail_body=body))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code in (502, 503), response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert group.decode[0].engine.records == []
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_usage_is_counted_once_from_the_decode_leg(start_sim: StartSim, start_gateway: StartGateway,
                                                   mode: str) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    _settled(group, gw)
    assert gw.metric('kimi_gateway_tokens_total{kind="completion"') == usage["completion_tokens"]
    assert gw.metric('kimi_gateway_tokens_total{kind="prompt"') == usage["prompt_tokens"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_batched_completions(start_sim: StartSim, start_gateway: StartGateway, mode: str,
                                      stream: bool) -> None:
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": ["one", "two", "three"],
                                                        "max_tokens": 4, "stream": stream}, timeout=10)
    assert response.status_code == 200, response.text
    if not stream:
        assert len(response.json()["choices"]) == 3
    else:
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_decode_dying_mid_stream_ends_with_one_sse_error(start_sim: StartSim, start_gateway: StartGateway,
                                                         mode: str) -> None:
    group = pd_group(start_sim, mode)
    group.decode[0].engine.set_faults(SimFaults(drop_after_chunks=2))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert response.status_code == 200
    assert response.text.count('"error"') == 1 and "[DONE]" not in response.text
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_decode_refusing_the_request_is_an_openai_error(start_sim: StartSim, start_gateway: StartGateway,
                                                        mode: str) -> None:
    group = pd_group(start_sim, mode)
    group.decode[0].engine.set_faults(SimFaults(fail_status=400))
    gw = start_gateway([group.pool()])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}
    _settled(group, gw)


def _reload(gw: RunningGateway, pools: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """Apply a new pool list to the running gateway, as SIGHUP / POST /admin/reload do."""
    new = parse_config({"pools": pools, "health": {"interval": 0.5, "timeout": 1.0, "verify_models": False}},
                       environ={})

    async def apply() -> list[str]:
        return apply_config(gw.server.app.state.gateway, new).changes

    return gw.server.call(apply())


@pytest.mark.parametrize("mode", MODES)
def test_reload_aggregated_to_pd_and_back_while_streams_flow(start_sim: StartSim, start_gateway: StartGateway,
                                                             mode: str) -> None:
    aggregated = start_sim(ENGINE[mode], tpot_s=0.02)
    group = pd_group(start_sim, mode, tpot_s=0.02)
    agg_pool = pool("p", ENGINE[mode], [aggregated.url], 131072)
    gw = start_gateway([agg_pool])
    stream_body = {**CHAT, "stream": True, "max_tokens": 10}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=stream_body, timeout=10) as first:
        assert first.status_code == 200
        chunks = first.iter_bytes()
        next(chunks)
        changes = _reload(gw, [group.pool("p")])
        assert changes
        rest = b"".join(chunks)
    assert rest.rstrip().endswith(b"data: [DONE]")
    pd_answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert pd_answer.status_code == 200, pd_answer.text
    assert pd_answer.headers["x-kimi-gateway-decode-worker"].startswith("p/")
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=stream_body, timeout=10) as second:
        assert second.status_code == 200
        chunks = second.iter_bytes()
        next(chunks)
        _reload(gw, [agg_pool])
        rest = b"".join(chunks)
    assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
    back = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert back.status_code == 200, back.text
    assert "x-kimi-gateway-prefill-worker" not in back.headers
    _settled(group, gw)
    deadline = time.monotonic() + 5  # the removed PD workers' series go at the next retired-worker sweep (1 s)
    while gw.metric("kimi_gateway_worker_role{") != 0:
        assert time.monotonic() < deadline, "the removed PD workers' role series stayed"
        time.sleep(0.05)


@pytest.mark.parametrize("params", ['"garbage"', "[1, 2]", "7"])
def test_nixl_prefill_with_a_non_object_kv_transfer_params_fails_over(start_sim: StartSim,
                                                                      start_gateway: StartGateway,
                                                                      params: str) -> None:
    """A prefill answer whose kv_transfer_params is not an object is the prefill worker's fault: the
    decode leg never gets it (vLLM would refuse it with a 400 the client would be blamed for)."""
    group = pd_group(start_sim, "vllm-nixl", prefill=2)
    group.prefill[0].engine.set_faults(SimFaults(fail_status=200, fail_body=f'{{"kv_transfer_params": {params}}}'))
    gw = start_gateway([group.pool(disaggregation={"prefill_policy": "round_robin"})])
    response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["x-kimi-gateway-prefill-worker"] == "pd/1"
    assert response.headers["x-kimi-gateway-attempts"] == "2"
    (d_rec,) = group.decode[0].engine.records
    assert isinstance(d_rec.body["kv_transfer_params"], dict)
    _settled(group, gw)


def _hang_up_when(gw: RunningGateway, body: dict, ready: Callable[[], object]) -> None:  # type: ignore[type-arg]
    """Send `body` on a raw socket, close it once `ready()` is truthy (polled, 5 s at most)."""
    raw = orjson.dumps(body)
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                       b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        deadline = time.monotonic() + 5
        while not ready():
            assert time.monotonic() < deadline, "the phase to hang up in never came"
            time.sleep(0.01)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_during_the_kv_handoff_aborts_the_decode_leg(start_sim: StartSim, start_gateway: StartGateway,
                                                                 mode: str, stream: bool) -> None:
    """The prefill leg finished; the decode leg runs but sent no content yet (slow TTFT): the
    client hangs up and the decode leg is aborted, the gauges go back to 0."""
    group = pd_group(start_sim, mode, decode=0)
    group.decode = [start_sim(ENGINE[mode], pd_role="decode", pd_protocol=mode, ttft_s=3.0)]
    gw = start_gateway([group.pool()])
    prefill, decode = group.prefill[0].engine, group.decode[0].engine
    _hang_up_when(gw, {**CHAT, "stream": stream},
                  lambda: decode.records and prefill.records and prefill.records[0].finished_at is not None)
    records = decode.wait_for(lambda: all(r.finished_at is not None for r in decode.records) and decode.records)
    assert [r.aborted for r in records] == [True]
    _settled(group, gw)


def test_a_pd_pool_without_a_live_prefill_worker_answers_503(start_sim: StartSim,
                                                             start_gateway: StartGateway) -> None:
    """Every prefill worker refuses connections (two workers failing alike with a 5xx are the
    request's fault by design, so dead ones it is): a clean 503, the decode worker never blamed."""
    group = pd_group(start_sim, "sglang", prefill=0)
    config = group.pool(spillover=False)
    config["disaggregation"]["prefill"] = [{"url": f"http://127.0.0.1:{free_port()}", "bootstrap_port": 8998}
                                           for _ in range(2)]
    gw = start_gateway([config])
    for stream in (False, True, False):
        answer = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
        assert answer.status_code == 503, answer.text
        assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    assert [w["state"] for w in workers if w["role"] == "decode"] == ["healthy"]
    decode = group.decode[0].engine
    decode.wait_for(lambda: all(r.finished_at is not None for r in decode.records) or None)
    assert all(r.aborted for r in decode.records)
    gw.wait_until_idle()
    assert gw.metric("kimi_gateway_in_flight{") == 0


def test_the_decode_limit_per_worker_is_kept(start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "vllm-nixl", prefill=2, tpot_s=0.05)
    gw = start_gateway([group.pool(queue_timeout=0.0, spillover=False,
                                   disaggregation={"decode_max_in_flight_per_worker": 1})])
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True, "max_tokens": 200},
                      timeout=10) as first:
        assert first.status_code == 200
        second = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "server_overloaded"
    assert len(group.decode[0].engine.records) == 1
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_pd_engines_find_too_long_goes_on_to_the_larger_pool(start_sim: StartSim,
                                                                          start_gateway: StartGateway,
                                                                          mode: str, stream: bool) -> None:
    """The PD pool's engines count more tokens than the gateway's estimate (1 per byte): their
    "too long" (from either leg, whichever answers first) sends the request on to the larger pool."""
    group = pd_group(start_sim, mode, max_context_tokens=4096, bytes_per_token=1.0)
    big = start_sim("vllm", max_context_tokens=65536)
    gw = start_gateway([group.pool("pd", 4096), pool("big", "vllm", [big.url], 65536)])
    body = {**CHAT, "messages": [{"role": "user", "content": "word " * 1000}], "max_tokens": 4, "stream": stream}
    answer = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kimi-gateway-pool"] == "big"
    assert answer.headers["x-kimi-gateway-attempts"] == "2"
    assert len(big.engine.records) == 1
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_a_keys_tokens_are_settled_from_the_decode_leg_only(start_sim: StartSim, start_gateway: StartGateway,
                                                            mode: str) -> None:
    """The prefill leg's own usage (its one token) is never charged: a key's tokens are the decode
    leg's usage, streamed or not."""
    group = pd_group(start_sim, mode)
    gw = start_gateway([group.pool(default_output_tokens=500)],
                       auth=auth_section({"tokens_per_minute": 1000, "requests_per_minute": 1000}),
                       affinity={"enabled": False}, load={"enabled": False})
    start_a_window_now(gw)
    headers = {"authorization": f"Bearer {ALICE_KEY}"}
    hi = [{"role": "user", "content": "Hi"}]  # estimated at 41 prompt tokens

    def used_now() -> int:  # the key's use, from the 429 of a probe too large to fit (a refusal costs nothing)
        probe = httpx.post(gw.v1 + "/chat/completions", headers=headers, timeout=10,
                           json={"model": "kimi-k3", "messages": hi, "max_tokens": 990 - 41})
        assert probe.status_code == 429, probe.text
        match = re.search(r"Used (\d+), Requested (\d+)", probe.json()["error"]["message"])
        assert match is not None
        return int(match[1])

    first = httpx.post(gw.v1 + "/chat/completions", headers=headers, timeout=10,
                       json={"model": "kimi-k3", "messages": hi, "max_tokens": 8})
    assert first.status_code == 200, first.text
    total = first.json()["usage"]["total_tokens"]
    assert used_now() == total
    with httpx.stream("POST", gw.v1 + "/chat/completions", headers=headers, timeout=10,
                      json={"model": "kimi-k3", "messages": hi, "max_tokens": 8, "stream": True}) as streamed:
        assert streamed.status_code == 200
        assert b"[DONE]" in streamed.read()
    deadline = time.monotonic() + 5
    while (used := used_now()) != 2 * total:
        assert time.monotonic() < deadline, f"the key's use stayed at {used}, not {2 * total}"
        time.sleep(0.02)
    _settled(group, gw)


def test_client_gone_during_a_nixl_deferred_streams_keepalives_aborts_the_prefill(start_sim: StartSim,
                                                                                 start_gateway: StartGateway) -> None:
    """A NIXL prefill outlasting the hold window committed the stream (keep-alives): the client hangs
    up then; the prefill leg is aborted, no decode leg goes out, every slot is released."""
    group = pd_group(start_sim, "vllm-nixl", prefill=0)
    group.prefill = [start_sim("vllm", pd_role="prefill", pd_protocol="vllm-nixl", ttft_s=3.0)]
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.1, "keepalive_interval": 0.05})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        assert next(response.iter_bytes()).startswith(b": keep-alive")
    prefill = group.prefill[0].engine
    records = prefill.wait_for(lambda: all(r.finished_at is not None for r in prefill.records) and prefill.records)
    assert [r.aborted for r in records] == [True]
    assert group.decode[0].engine.records == []
    _settled(group, gw)


@pytest.mark.parametrize("committed", [False, True])
def test_prefill_connection_dropped_mid_answer(start_sim: StartSim, start_gateway: StartGateway,
                                               committed: bool) -> None:
    """The only prefill worker drops its connection without an end (before or after the client's
    stream was committed): the client gets a clean end (an OpenAI error, one SSE error event or the
    whole answer when the KV had arrived), never a hang; no leg is left running. SGLang: its
    prefill leg is the streamed request (the sim's drop fault is for streams only)."""
    mode = "sglang"
    group = pd_group(start_sim, mode, prefill=0)
    group.prefill = [start_sim(ENGINE[mode], pd_role="prefill", pd_protocol=mode, ttft_s=0.4,
                               faults={"drop_after_chunks": 0})]
    timeouts = {"hold_headers": 0.1, "keepalive_interval": 0.05} if committed else {}
    gw = start_gateway([group.pool(spillover=False)], timeouts=timeouts)
    answer = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    if answer.status_code == 200:
        text = answer.text
        assert (text.count('"error"') == 1 and "[DONE]" not in text) or text.rstrip().endswith("data: [DONE]"), text
    else:
        assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    _settled(group, gw)


@pytest.mark.parametrize("mode", ["sglang", "vllm-mooncake"])
def test_a_decode_aborted_for_its_dead_prefill_partner_is_not_blamed(start_sim: StartSim,
                                                                     start_gateway: StartGateway, mode: str) -> None:
    """The committed decode leg is aborted because its prefill worker died: the prefill worker is
    at fault, not the decode worker (with one passive failure to eject, it must stay in)."""
    group = pd_group(start_sim, mode)
    group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True))
    gw = start_gateway([group.pool()], timeouts={"hold_headers": 0.2, "keepalive_interval": 0.1},
                       health={**WEDGE_PROBES, "passive_failures": 1, "ejection_base": 30})
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        assert next(chunks)
        group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True, black_hole=True))
        rest = b"".join(chunks)
    assert rest.count(b'"error"') == 1 and b"[DONE]" not in rest
    gw.wait_until_idle()
    workers = httpx.get(gw.url + "/admin/workers").json()["pools"][0]["workers"]
    decode_state = [(w["state"], w.get("last_error")) for w in workers if w["role"] == "decode"]
    assert decode_state[0][0] == "healthy", decode_state


def test_a_restarted_mooncake_prefill_engine_is_found_again(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The prefill engine restarted with a new engine id (its prefill legs still succeed): the
    decode leg naming the old id fails, and the gateway reads the id again instead of failing every
    request from then on."""
    group = pd_group(start_sim, "vllm-mooncake", decode=2)
    gw = start_gateway([group.pool(disaggregation={"decode_policy": "round_robin"})])
    assert httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10).status_code == 200
    group.prefill[0].engine.pd.engine_id = "restarted-engine"  # as a restarted vLLM draws a new one
    for _ in range(3):
        answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 200, answer.text
    last = group.decode[0].engine.records[-1], group.decode[1].engine.records[-1]
    assert all(r.body["kv_transfer_params"]["remote_engine_id"] == "restarted-engine" for r in last)
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_both_legs_too_slow_for_the_first_byte_budget(start_sim: StartSim, start_gateway: StartGateway,
                                                      mode: str) -> None:
    """Both legs slower than the stream's first-content budget: an OpenAI error (no hang, the
    client's timeout is never reached), every leg ended."""
    group = pd_group(start_sim, mode, ttft_s=2.0)
    gw = start_gateway([group.pool(spillover=False)], max_attempts=1,
                       timeouts={"first_byte_base": 0.3, "first_byte_per_1k_tokens": 0, "response_header": 0.3})
    started = time.monotonic()
    answer = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    took = time.monotonic() - started
    assert answer.status_code in (502, 503, 504), (took, dict(answer.headers), answer.text[:400],
                                                    [(r.aborted, r.completed) for s in group.all()
                                                     for r in s.engine.records])
    assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_requests_queued_in_a_pd_pool_a_reload_removes_get_a_503(start_sim: StartSim, start_gateway: StartGateway,
                                                                 mode: str) -> None:
    """The PD pool takes one request at a time; two more wait in its queue when a reload replaces it:
    woken when the first ends, they get an OpenAI-style 503, not a crash; no leg is left running."""
    group = pd_group(start_sim, mode, ttft_s=0.4)
    other = start_sim("vllm")
    gw = start_gateway([group.pool(max_in_flight=1, queue_timeout=30)])
    with ThreadPoolExecutor(3) as pool_of_clients:
        sends = [pool_of_clients.submit(httpx.post, gw.v1 + "/chat/completions", json=CHAT, timeout=10)
                 for _ in range(3)]
        deadline = time.monotonic() + 5
        while gw.metric('kimi_gateway_estimated_prompt_tokens_count{method="bytes",pool="pd"}') < 3:
            assert time.monotonic() < deadline, "the requests were not all routed"
            time.sleep(0.02)
        assert not any(s.done() for s in sends)
        _reload(gw, [pool("q", "vllm", [other.url], 131072)])
        answers = [s.result(timeout=10) for s in sends]
    assert sorted(a.status_code for a in answers) == [200, 503, 503], [a.text for a in answers]
    for answer in answers:
        if answer.status_code == 503:
            assert "removed by a reload" in answer.json()["error"]["message"]
    assert len(group.prefill[0].engine.records) == 1
    _settled(group, gw)


@pytest.mark.parametrize(("prompt", "rooms"), [([[11, 12, 13], [14, 15]], 2), ([11, 12, 13], None), (["one"], 1)])
def test_sglang_rooms_for_token_prompts(start_sim: StartSim, start_gateway: StartGateway, prompt: list[object],
                                        rooms: int | None) -> None:
    """A list of token lists is a batch (one room each); one token list is one prompt (one room)."""
    group = pd_group(start_sim, "sglang")
    gw = start_gateway([group.pool()])
    answer = httpx.post(gw.v1 + "/completions", json={"model": "kimi-k3", "prompt": prompt, "max_tokens": 2},
                        timeout=10)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == (rooms or 1)
    (d_rec,) = group.decode[0].engine.records
    room = d_rec.body["bootstrap_room"]
    assert (len(room) if isinstance(room, list) else None) == rooms
    _settled(group, gw)


def test_nixl_prefill_answer_without_kv_transfer_params_runs_the_decode_aggregated(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A prefill answer with no kv_transfer_params (a worker without the NIXL connector) is passed on
    as null, as vllm-router does: the decode worker prefills the prompt itself and the client gets
    its answer."""
    group = pd_group(start_sim, "vllm-nixl")
    group.prefill[0].engine.set_faults(SimFaults(fail_status=200, fail_body='{"choices": []}'))
    gw = start_gateway([group.pool()])
    answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert answer.status_code == 200, answer.text
    (d_rec,) = group.decode[0].engine.records
    assert d_rec.body["kv_transfer_params"] is None and d_rec.completed
    _settled(group, gw)


def _wedged(gw: RunningGateway, sim) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The /admin/workers entry of `sim`'s worker."""
    pools = httpx.get(gw.url + "/admin/workers").json()["pools"]
    return next(w for p in pools for w in p["workers"] if w["url"] == sim.url)


@pytest.mark.parametrize("mode", MODES)
def test_a_wedged_prefill_worker_is_failed_over_within_its_budget_and_charged(start_sim: StartSim,
                                                                              start_gateway: StartGateway,
                                                                              mode: str) -> None:
    """A prefill worker that accepts its leg and never answers, its health probe green (issue 26 §5):
    a non-streamed request goes on to the other prefill worker after the prefill leg's budget
    (`first_byte_base` here, not the request's whole answer budget of a minute), and the wedged
    worker is charged: ejected, it gets no more legs."""
    group = pd_group(start_sim, mode, prefill=2)
    group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True))
    gw = start_gateway([group.pool(disaggregation={"prefill_policy": "round_robin"})],
                       timeouts={"first_byte_base": 0.5, "first_byte_per_1k_tokens": 0},
                       health={"passive_failures": 1, "ejection_base": 60})
    for _ in range(3):
        started = time.monotonic()
        answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started < 5
        assert answer.headers["x-kimi-gateway-prefill-worker"] != _wedged(gw, group.prefill[0])["id"]
    assert len(group.prefill[0].engine.records) == 1  # tried once, then ejected
    wedged = _wedged(gw, group.prefill[0])
    assert wedged["state"] == "ejected" and "prefill" in wedged["last_error"], wedged
    _settled(group, gw)


def test_a_pd_pool_whose_only_prefill_worker_is_wedged_spills_over(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    """The PD pool's only prefill worker wedged (probe green): after the prefill leg's budget the
    request goes on to the next pool, as for any failed attempt."""
    group = pd_group(start_sim, "vllm-nixl")
    group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True))
    aggregated = start_sim("vllm")
    gw = start_gateway([group.pool("pd", 131072), pool("agg", "vllm", [aggregated.url], 262144)],
                       timeouts={"prefill_first_byte": 0.5})
    started = time.monotonic()
    answer = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kimi-gateway-pool"] == "agg" and time.monotonic() - started < 5
    assert group.decode[0].engine.records == []
    _settled(group, gw)


@pytest.mark.parametrize("mode", MODES)
def test_a_hang_up_while_the_prefill_leg_is_unanswered_is_held_against_the_prefill_worker(
        start_sim: StartSim, start_gateway: StartGateway, mode: str) -> None:
    """The client gives up (after the no-token answer budget) while a wedged prefill worker has not
    answered its leg: that worker is charged, not the decode worker waiting for its KV."""
    group = pd_group(start_sim, mode)
    group.prefill[0].engine.set_faults(SimFaults(hang_before_headers=True))
    gw = start_gateway([group.pool(spillover=False)],
                       timeouts={"first_byte_base": 0.2, "first_byte_per_1k_tokens": 0, "generation": 0.2,
                                 "prefill_first_byte": 60},
                       health={"passive_failures": 1, "ejection_base": 60})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=1.0)
    deadline = time.monotonic() + 5
    while _wedged(gw, group.prefill[0])["state"] != "ejected":
        assert time.monotonic() < deadline, _wedged(gw, group.prefill[0])
        time.sleep(0.05)
    assert _wedged(gw, group.decode[0])["state"] == "healthy"
    _settled(group, gw)
