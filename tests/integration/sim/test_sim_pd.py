"""The simulator's prefill/decode roles over real HTTP: SGLang bootstrap rooms and vLLM NIXL
`kv_transfer_params`, the failures of each protocol, KV transfer time, the prefill prefix cache and
the PD metrics. The router's part is played by the test (the real routers: test_sim_pd_peers.py)."""

from __future__ import annotations

import json
import random
import socket
import string
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.sim import SimConfig, SimFaults
from tests.support import RunningSim, free_port

StartSim = Callable[..., RunningSim]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters + " ") for _ in range(n))


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `predicate` (PD counters change without waking `SimWorkerState.wait_for`) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _sglang_pair(start_sim: StartSim, **fields: Any) -> tuple[RunningSim, RunningSim]:
    prefill = start_sim("sglang", pd_role="prefill", pd_protocol="sglang", **fields)
    decode = start_sim("sglang", pd_role="decode", pd_protocol="sglang", **fields)
    return prefill, decode


def _bootstrap(prefill: RunningSim, room: int) -> dict[str, Any]:
    host, port = prefill.url.removeprefix("http://").rsplit(":", 1)
    return {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": room}


def _both(prefill: RunningSim, decode: RunningSim, path: str, body: dict[str, Any]) -> tuple[httpx.Response, ...]:
    """What SGLang's router does: the same body to both workers at once."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, srv.url + path, json=body, timeout=10) for srv in (prefill, decode)]
        return tuple(f.result() for f in futures)


def _nixl_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's router's prefill leg (vllm_pd_router.rs `prepare_prefill_request`)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    return out


def _nixl(prefill: RunningSim, decode: RunningSim, path: str, body: dict[str, Any]) -> tuple[dict[str, Any],
                                                                                             httpx.Response]:
    """vLLM's router's two stages: (prefill answer, decode response)."""
    headers = {"X-Request-Id": f"___prefill_addr_p___decode_addr_d_{random.getrandbits(64):x}"}
    first = httpx.post(prefill.url + path, json=_nixl_prefill_body(body), headers=headers, timeout=10)
    assert first.status_code == 200, first.text
    answer = first.json()
    second = httpx.post(decode.url + path, json={**body, "kv_transfer_params": answer.get("kv_transfer_params")},
                        headers=headers, timeout=10)
    return answer, second


# --- SGLang --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_sglang_pair_serves_the_same_body_on_both_workers(start_sim: StartSim, path: str) -> None:
    prefill, decode = _sglang_pair(start_sim, kv_transfer_tokens_per_s=1_000_000)
    body = ({"messages": [{"role": "user", "content": _text(400, 1)}]} if path == CHAT
            else {"prompt": _text(400, 1)}) | {"model": "kimi-k3", "max_tokens": 5, **_bootstrap(prefill, 12345)}
    p_resp, d_resp = _both(prefill, decode, path, body)
    assert (p_resp.status_code, d_resp.status_code) == (200, 200), (p_resp.text, d_resp.text)
    assert d_resp.json()["usage"]["completion_tokens"] == 5
    assert p_resp.json()["usage"]["completion_tokens"] == 1  # the prefill worker stops at the first token
    d_rec, = decode.engine.records
    assert d_rec.kv_transfer_tokens == d_rec.prompt_tokens >= 100
    assert d_rec.pd_failure is None
    assert _metric(decode.url, "sglang:kv_transfer_latency_ms_count") == 1


def test_sglang_batched_rooms_are_lists(start_sim: StartSim) -> None:
    prefill, decode = _sglang_pair(start_sim)
    host, port = prefill.url.removeprefix("http://").rsplit(":", 1)
    body = {"model": "kimi-k3", "prompt": ["one prompt", "another prompt"], "max_tokens": 2,
            "bootstrap_host": [host, host], "bootstrap_port": [int(port)] * 2, "bootstrap_room": [7, 8]}
    p_resp, d_resp = _both(prefill, decode, TEXT, body)
    assert (p_resp.status_code, d_resp.status_code) == (200, 200), (p_resp.text, d_resp.text)
    assert len(d_resp.json()["choices"]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_decode_fails_when_the_room_never_arrives(start_sim: StartSim, stream: bool) -> None:
    prefill, decode = _sglang_pair(start_sim, pd_wait_timeout_s=0.3)
    body = {"model": "kimi-k3", "prompt": "hello", "max_tokens": 3, "stream": stream, **_bootstrap(prefill, 99)}
    start = time.monotonic()
    resp = httpx.post(decode.url + TEXT, json=body, timeout=10)  # the prefill worker never gets it
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 2.0
    if stream:  # headers went out at once: the error comes in the stream
        assert resp.status_code == 200
        assert b"KVPoll.WaitingForInput" in resp.content and resp.content.endswith(b"data: [DONE]\n\n")
    else:
        assert resp.status_code == 500
        message = resp.json()["message"]
        assert message.startswith("Decode transfer failed for request rank=0 with exception "
                                  "KVTransferError(bootstrap_room=99): Request 99 timed out after 0.")
        assert message.endswith("s in KVPoll.WaitingForInput")
    assert decode.engine.records[0].pd_failure == "transfer"
    assert _metric(decode.url, "sglang:num_transfer_failed_reqs_total") == 1
    assert _metric(decode.url, "sglang:num_decode_transfer_queue_reqs") == 0


def test_sglang_prefill_fails_when_no_decode_bootstraps(start_sim: StartSim) -> None:
    prefill = start_sim("sglang", pd_role="prefill", pd_protocol="sglang", pd_wait_timeout_s=0.2)
    resp = httpx.post(prefill.url + TEXT, json={"model": "kimi-k3", "prompt": "hi", **_bootstrap(prefill, 5)})
    assert resp.status_code == 500
    assert "Request 5 timed out after" in resp.json()["message"]
    assert resp.json()["message"].endswith("in KVPoll.Bootstrapping")
    assert _metric(prefill.url, "sglang:num_bootstrap_failed_reqs_total") == 1


def test_sglang_decode_with_an_unreachable_bootstrap_server_fails_at_once(start_sim: StartSim) -> None:
    decode = start_sim("sglang", pd_role="decode", pd_protocol="sglang")
    body = {"model": "kimi-k3", "prompt": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(),
            "bootstrap_room": 1}
    resp = httpx.post(decode.url + TEXT, json=body, timeout=10)
    assert resp.status_code == 500
    assert "Could not fetch prefill parallel info from bootstrap_addr" in resp.json()["message"]


def test_sglang_request_without_bootstrap_fields_is_refused(start_sim: StartSim) -> None:
    decode = start_sim("sglang", pd_role="decode", pd_protocol="sglang")
    resp = httpx.post(decode.url + TEXT, json={"model": "kimi-k3", "prompt": "hi"})
    assert resp.status_code == 400
    assert "bootstrap_host" in resp.json()["message"]
    assert decode.engine.sim_stats()["running"] == 0


# --- vLLM NIXL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_nixl_prefill_answers_a_handle_that_the_decode_pulls(start_sim: StartSim, path: str) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-nixl", engine_id="engine-p")
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl")
    body = ({"messages": [{"role": "user", "content": _text(800, 2)}]} if path == CHAT
            else {"prompt": _text(800, 2)}) | {"model": "kimi-k3", "max_tokens": 4, "stream": True,
                                               "stream_options": {"include_usage": True}}
    answer, resp = _nixl(prefill, decode, path, body)
    params = answer["kv_transfer_params"]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "engine-p"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == int(prefill.url.rsplit(":", 1)[1])
    assert len(params["remote_block_ids"]) == prompt_tokens // 16
    assert params["tp_size"] == 1 and params["remote_request_id"].split("-")[0] in ("chatcmpl", "cmpl")
    assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    d_rec, = decode.engine.records
    assert d_rec.kv_transfer_tokens == (prompt_tokens // 16) * 16
    assert prefill.engine.pd is not None and prefill.engine.pd.held_handles == 0  # read, so freed
    assert _metric(decode.url, "vllm:nixl_xfer_time_seconds_count") == 1


def test_nixl_decode_without_params_runs_aggregated(start_sim: StartSim) -> None:
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl", prefill_tokens_per_s=10_000)
    resp = httpx.post(decode.url + TEXT, json={"model": "kimi-k3", "prompt": _text(400, 3), "max_tokens": 2,
                                               "kv_transfer_params": None})
    assert resp.status_code == 200
    assert resp.json()["kv_transfer_params"] is None
    rec, = decode.engine.records
    assert rec.kv_transfer_tokens == 0 and rec.prefill_tokens == rec.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_nixl_unknown_handle_fails_the_request(start_sim: StartSim, stream: bool) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-nixl")
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl")
    answer, first = _nixl(prefill, decode, TEXT, {"model": "kimi-k3", "prompt": _text(400, 4), "max_tokens": 2})
    assert first.status_code == 200
    # The same handle again: its blocks were read and freed, so the prefill worker no longer knows it.
    again = httpx.post(decode.url + TEXT, json={"model": "kimi-k3", "prompt": _text(400, 4), "max_tokens": 2,
                                                "stream": stream, "kv_transfer_params": answer["kv_transfer_params"]})
    if stream:
        assert again.status_code == 200
        assert b'"message":"Internal server error"' in again.content
    else:
        assert again.status_code == 500
        assert again.json()["error"] == {"message": "Internal server error", "type": "InternalServerError",
                                         "param": None, "code": 500}
    assert decode.engine.records[-1].pd_failure == "unknown_handle"
    assert _metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 1


def test_nixl_recompute_policy_prefills_locally(start_sim: StartSim) -> None:
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl", kv_load_failure_policy="recompute")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
              "remote_engine_id": "nobody", "remote_request_id": "cmpl-x", "remote_host": "127.0.0.1",
              "remote_port": free_port(), "tp_size": 1}
    resp = httpx.post(decode.url + TEXT, json={"model": "kimi-k3", "prompt": _text(400, 5), "max_tokens": 2,
                                               "kv_transfer_params": params})
    assert resp.status_code == 200
    rec, = decode.engine.records
    assert rec.pd_failure == "transfer" and rec.kv_transfer_tokens == 0


def test_nixl_held_blocks_expire_unread(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-nixl", kv_hold_timeout_s=0.2,
                        kv_capacity_tokens=10_000)
    body = _nixl_prefill_body({"model": "kimi-k3", "prompt": _text(800, 6)})
    resp = httpx.post(prefill.url + TEXT, json=body)
    assert resp.status_code == 200
    pd = prefill.engine.pd
    assert pd is not None and pd.held_handles == 1
    assert prefill.engine.sim_stats()["kv_usage"] > 0  # the held blocks stay pinned
    _until(lambda: pd.held_handles == 0)
    assert _metric(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert prefill.engine.sim_stats()["kv_usage"] == 0
    read = httpx.post(prefill.url + "/sim/pd/nixl/read", json={
        "remote_engine_id": pd.engine_id, "remote_request_id": "x", "remote_block_ids": [1]})
    assert read.status_code == 404


def test_transfer_time_grows_with_the_decode_workers_uncached_tokens(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-nixl", kv_capacity_tokens=100_000)
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl", kv_transfer_tokens_per_s=20_000,
                       kv_capacity_tokens=100_000)
    short, long_ = _text(4_000, 7), _text(12_000, 8)
    for prompt in (short, long_, long_ + _text(800, 9)):
        _, resp = _nixl(prefill, decode, TEXT, {"model": "kimi-k3", "prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 200
    short_rec, long_rec, again_rec = decode.engine.records
    # 1,000 and 3,000 prompt tokens: the prefill worker hands over full 16-token blocks only.
    assert (short_rec.kv_transfer_tokens, long_rec.kv_transfer_tokens) == (992, 2992)
    assert long_rec.kv_transfer_s == pytest.approx(2992 / 20_000)
    assert short_rec.kv_transfer_s == pytest.approx(992 / 20_000)
    assert long_rec.first_byte_at is not None and long_rec.first_byte_at - long_rec.received_at >= 2992 / 20_000
    # The decode worker cached the long prompt itself: of 3,200 tokens only the uncached tail comes.
    assert again_rec.cached_tokens == 2992 and again_rec.kv_transfer_tokens == 3200 - 2992


def test_prefill_workers_keep_the_prefix_cache(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-nixl", kv_capacity_tokens=100_000)
    decode = start_sim(pd_role="decode", pd_protocol="vllm-nixl")
    shared = _text(8_000, 9)
    for tail in ("first question", "second question"):
        _, resp = _nixl(prefill, decode, TEXT, {"model": "kimi-k3", "prompt": shared + tail, "max_tokens": 1})
        assert resp.status_code == 200
    first, second = prefill.engine.records
    assert (first.cached_tokens, second.cached_tokens) == (0, 2000)
    assert _metric(prefill.url, "vllm:prefix_cache_hits_total") == 2000
    stats = prefill.engine.sim_stats()
    assert stats["cached_tokens"] / stats["prompt_tokens"] == pytest.approx(2000 / (2004 + 2004), abs=0.001)
    assert stats["pd"]["held_handles"] == 0


def test_pd_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="go together"):
        SimConfig(engine="vllm", max_context_tokens=1000, pd_role="prefill")
    with pytest.raises(ValidationError, match="needs engine 'sglang'"):
        SimConfig(engine="vllm", max_context_tokens=1000, pd_role="decode", pd_protocol="sglang")
    with pytest.raises(ValidationError, match="needs engine 'vllm' or 'ascend'"):
        SimConfig(engine="sglang", max_context_tokens=1000, pd_role="decode", pd_protocol="vllm-nixl")


def test_sglang_client_leaving_a_waiting_decode_releases_both_sides(start_sim: StartSim) -> None:
    prefill, decode = _sglang_pair(start_sim, pd_wait_timeout_s=30)
    body = {"model": "kimi-k3", "prompt": "hello", **_bootstrap(prefill, 77)}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the decode waits for the room's KV
        httpx.post(decode.url + TEXT, json=body, timeout=httpx.Timeout(5, read=0.3))
    rec = decode.engine.wait_for(lambda: [r for r in decode.engine.records if r.aborted], timeout=5)[0]
    assert rec.completion_tokens_sent == 0
    assert decode.engine.pd is not None and prefill.engine.pd is not None
    _until(lambda: decode.engine.sim_stats()["pd"]["waiting_for_kv"] == 0)
    _until(lambda: prefill.engine.pd is not None and prefill.engine.pd.open_rooms == 0)  # the claim call went


def test_sglang_client_leaving_a_bootstrapping_prefill_forgets_the_room(start_sim: StartSim) -> None:
    prefill = start_sim("sglang", pd_role="prefill", pd_protocol="sglang", pd_wait_timeout_s=30)
    body = {"model": "kimi-k3", "prompt": "hello", **_bootstrap(prefill, 78)}
    with pytest.raises(httpx.ReadTimeout):  # no decode worker bootstraps: the client gives up
        httpx.post(prefill.url + TEXT, json=body, timeout=httpx.Timeout(5, read=0.3))
    prefill.engine.wait_for(lambda: [r for r in prefill.engine.records if r.aborted], timeout=5)
    _until(lambda: prefill.engine.sim_stats()["pd"]["bootstrapping"] == 0)
    assert prefill.engine.pd is not None and prefill.engine.pd.open_rooms == 0
    assert _metric(prefill.url, "sglang:num_prefill_prealloc_queue_reqs") == 0



@pytest.mark.parametrize("wedged", [False, True], ids=["alive", "black-holed"])
def test_sglang_prefill_leg_ending_without_kv_tells_its_decode_unless_wedged(start_sim: StartSim,
                                                                             wedged: bool) -> None:
    """The prefill request's client leaves mid-prefill: a live prefill engine fails the decode worker
    waiting for that room's KV at once ("it might be dead"); one black-holed meanwhile (a wedged
    engine) tells it nothing, so only the decode's own client can end it (the gateway's abort, as
    test_pd_dispatch checks: there the decode ending itself first was a race)."""
    prefill = start_sim("sglang", pd_role="prefill", pd_protocol="sglang", pd_wait_timeout_s=30, ttft_s=30.0)
    decode = start_sim("sglang", pd_role="decode", pd_protocol="sglang", pd_wait_timeout_s=30)
    body = json.dumps({"model": "kimi-k3", "prompt": "hello", **_bootstrap(prefill, 79)}).encode()
    host, port = prefill.url.removeprefix("http://").rsplit(":", 1)
    with ThreadPoolExecutor(1) as pool, socket.create_connection((host, int(port))) as prefill_leg:
        prefill_leg.sendall(b"POST " + TEXT.encode() + b" HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
                            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _until(lambda: prefill.engine.sim_stats()["pd"]["bootstrapping"] == 1)  # waits for its decode partner
        waiting = pool.submit(httpx.post, decode.url + TEXT, content=body, timeout=httpx.Timeout(5, read=2.0))
        # claimed: the prefill computes the KV (30 s), the decode waits for it
        _until(lambda: prefill.engine.sim_stats()["pd"]["bootstrapping"] == 0
               and decode.engine.sim_stats()["pd"]["waiting_for_kv"] == 1)
        if wedged:
            prefill.engine.set_faults(SimFaults(black_hole=True))
        prefill_leg.close()  # the prefill leg's client leaves before the KV is computed
        if wedged:
            with pytest.raises(httpx.ReadTimeout):
                waiting.result()
            rec = decode.engine.wait_for(lambda: [r for r in decode.engine.records if r.finished_at], timeout=5)[0]
            assert rec.aborted and rec.pd_failure is None
        else:
            answer = waiting.result()
            assert answer.status_code == 500 and "it might be dead" in answer.text
            assert decode.engine.records[0].pd_failure == "transfer"

# --- vLLM Mooncake -------------------------------------------------------------------------------


def _mooncake_legs(prefill: RunningSim, body: dict[str, Any], transfer_id: str,
                   engine_id: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """vllm-router's two Mooncake legs (sent at once): (prefill body, decode body)."""
    assert prefill.engine.pd is not None
    p_body = _nixl_prefill_body(body)
    p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_body = {**body, "kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_bootstrap_addr": prefill.url, "remote_engine_id": engine_id or prefill.engine.pd.engine_id}}
    return p_body, d_body


def test_mooncake_bootstrap_query_names_the_prefill_engine(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-mooncake", engine_id="engine-P")
    port = prefill.url.rsplit(":", 1)[1]
    assert httpx.get(prefill.url + "/query").json() == {
        "0": {"engine_id": "engine-P", "worker_addr": {"0": {"0": f"127.0.0.1:{port}"}}}}
    decode = start_sim(pd_role="decode", pd_protocol="vllm-mooncake")
    assert httpx.get(decode.url + "/query").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
def test_mooncake_legs_sent_at_once_hand_the_kv_over(start_sim: StartSim, stream: bool) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-mooncake", kv_capacity_tokens=100_000,
                        prefill_tokens_per_s=20_000)
    decode = start_sim(pd_role="decode", pd_protocol="vllm-mooncake", kv_transfer_tokens_per_s=100_000)
    body = {"model": "kimi-k3", "prompt": _text(4_000, 10), "max_tokens": 3, "stream": stream}
    p_body, d_body = _mooncake_legs(prefill, body, "xfer-1")
    with ThreadPoolExecutor(2) as pool:  # decode first: it waits for the prefill of its transfer
        d_future = pool.submit(httpx.post, decode.url + TEXT, json=d_body, timeout=10)
        p_future = pool.submit(httpx.post, prefill.url + TEXT, json=p_body, timeout=10)
        p_resp, d_resp = p_future.result(), d_future.result()
    assert (p_resp.status_code, d_resp.status_code) == (200, 200), (p_resp.text, d_resp.text)
    assert p_resp.json()["kv_transfer_params"] is None  # Mooncake's prefill answer names nothing
    d_rec, = decode.engine.records
    assert d_rec.kv_transfer_tokens == 1000 and d_rec.pd_failure is None
    assert prefill.engine.pd is not None
    _until(lambda: prefill.engine.pd is not None and prefill.engine.pd.open_transfers == 0)
    assert prefill.engine.sim_stats()["kv_usage"] == 0  # taken, so freed
    assert _metric(decode.url, "vllm:mooncake_xfer_time_seconds_count") == 1


def test_mooncake_transfer_that_never_comes_fails_the_decode(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-mooncake")
    decode = start_sim(pd_role="decode", pd_protocol="vllm-mooncake", pd_wait_timeout_s=0.3)
    _, d_body = _mooncake_legs(prefill, {"model": "kimi-k3", "prompt": _text(400, 11)}, "xfer-lost")
    start = time.monotonic()
    resp = httpx.post(decode.url + TEXT, json=d_body, timeout=10)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal server error"
    assert decode.engine.records[0].pd_failure == "transfer"
    assert prefill.engine.pd is not None and prefill.engine.pd.open_transfers == 0


def test_mooncake_unknown_engine_fails_at_once(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-mooncake")
    decode = start_sim(pd_role="decode", pd_protocol="vllm-mooncake")
    _, d_body = _mooncake_legs(prefill, {"model": "kimi-k3", "prompt": _text(400, 12)}, "xfer-2", "engine-X")
    resp = httpx.post(decode.url + TEXT, json=d_body, timeout=10)
    assert resp.status_code == 500
    assert decode.engine.records[0].pd_failure == "unknown_handle"


def test_mooncake_prefill_holds_the_kv_until_it_expires(start_sim: StartSim) -> None:
    prefill = start_sim(pd_role="prefill", pd_protocol="vllm-mooncake", kv_capacity_tokens=10_000,
                        kv_hold_timeout_s=0.2)
    p_body, _ = _mooncake_legs(prefill, {"model": "kimi-k3", "prompt": _text(800, 13)}, "xfer-3")
    assert httpx.post(prefill.url + TEXT, json=p_body).status_code == 200
    pd = prefill.engine.pd
    assert pd is not None and pd.held_handles == 1 and prefill.engine.sim_stats()["kv_usage"] > 0
    _until(lambda: pd.held_handles == 0)
    assert prefill.engine.sim_stats()["pd"]["kv_expired"] == 1
    assert prefill.engine.sim_stats()["kv_usage"] == 0
