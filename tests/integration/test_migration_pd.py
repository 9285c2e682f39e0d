"""Mid-stream migration in a prefill/decode (PD) pool (issue 23): a stream whose simulated decode
worker fails after content reached the client goes on as a fresh prefill of prompt + text so far
on another prefill/decode pair, with fresh protocol fields (SGLang's bootstrap room, vLLM NIXL's
KV handle, vLLM Mooncake's transfer id: `gateway/protocol/pd.py`), and the client reads the
answer an uninterrupted run gives (the simulator's answer is a function of the token's position in
the assistant's turn: `gateway/sim/tokens.py`; its PD roles: `gateway/sim/pd.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.protocol.pd import BOOTSTRAP_ROOM, KV_TRANSFER_PARAMS, TRANSFER_ID
from gateway.sim.config import SimFaults
from tests.integration.pd_support import ENGINE, PdGroup, StartSim, pd_group
from tests.integration.test_migration import CHAT, FAULTS, PATHS, TEXT, access_lines, chunks, stream, text_of, usage_of
from tests.support import RunningGateway

StartGateway = Callable[..., RunningGateway]
MODES = ["sglang", "vllm-nixl", "vllm-mooncake"]
# The gap budget a stall runs past (`read`); the first byte may take longer on a PD pair's two legs.
TIMEOUTS = {"read": 0.5, "first_byte_base": 2.0, "first_byte_per_1k_tokens": 0}
HEALTH = {"interval": 30, "timeout": 1.0}
SEAM = b": x-kimi-gateway-migrated"


def setup(start_sim: StartSim, start_gateway: StartGateway, mode: str, faults: SimFaults,
          **settings: Any) -> tuple[PdGroup, RunningGateway]:
    """Two prefill workers (pd/0, pd/1) and two decode workers (pd/2, pd/3), each role's policy
    round robin (so the first request takes pd/0 and pd/2, and a second choice would be pd/1 and
    pd/3); the first decode worker has `faults`."""
    group = pd_group(start_sim, mode, prefill=2, decode=2)
    group.decode[0].engine.set_faults(faults)
    pool = group.pool(disaggregation={"decode_policy": "round_robin", "prefill_policy": "round_robin"},
                      **settings.pop("pool", {}))
    gw = start_gateway([pool], health=HEALTH, timeouts=TIMEOUTS, **settings)
    return group, gw


def reference(start_sim: StartSim, mode: str, api: str) -> list[bytes]:
    """The uninterrupted answer, from an aggregated simulator of the same engine."""
    sim = start_sim(ENGINE[mode])
    return stream(sim.url + "/v1" + PATHS[api], CHAT if api == "chat" else TEXT)[1]


def check_fresh_fields(mode: str, prefill: list[dict[str, Any]], decode: dict[str, Any]) -> None:
    """The continuation's pair got protocol fields of its own, not the first pair's."""
    first, second = prefill
    if mode == "sglang":  # the same body to both legs, a new room
        assert first[BOOTSTRAP_ROOM] != second[BOOTSTRAP_ROOM] == decode[BOOTSTRAP_ROOM]
    elif mode == "vllm-mooncake":  # both legs tied by a new transfer id
        assert first[KV_TRANSFER_PARAMS][TRANSFER_ID] != second[KV_TRANSFER_PARAMS][TRANSFER_ID] \
            == decode[KV_TRANSFER_PARAMS][TRANSFER_ID]
    else:  # NIXL: the decode leg carries the handle the second prefill answered
        assert second[KV_TRANSFER_PARAMS]["do_remote_decode"] is True
        assert decode[KV_TRANSFER_PARAMS]["do_remote_prefill"] is True


def run_and_check(start_sim: StartSim, group: PdGroup, gw: RunningGateway, mode: str, api: str,
                  caplog: pytest.LogCaptureFixture) -> None:
    body = CHAT if api == "chat" else TEXT
    expected = reference(start_sim, mode, api)
    response, events = stream(gw.v1 + PATHS[api], body)
    assert response.status_code == 200 and response.headers["x-kimi-gateway-decode-worker"] == "pd/2"
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events), events
    assert text_of(api, events) == text_of(api, expected)  # nothing repeated or lost at the seam
    assert len({(c["id"], c["created"], c["model"]) for c in chunks(events)}) == 1  # one stream
    kept = 7 if api == "chat" else 8  # 8 events relayed; a chat stream's first is its role chunk
    assert [e for e in events if e.startswith(SEAM)] == [
        f": x-kimi-gateway-migrated from=pd/2 to=pd/3 prefill=pd/0 kept_tokens={kept}".encode()]
    assert usage_of(events) == usage_of(expected)  # the original prompt, every generated token
    # A second prefill (on the healthy prefill worker, which holds the prompt's prefix cache) and
    # a second decode on the other decode worker, both asked to continue the text so far. The
    # prefill policy's own next choice would have been the other prefill worker.
    prefills = [r.body for r in group.prefill[0].engine.records]
    assert len(prefills) == 2 and group.prefill[1].engine.records == [] and len(group.decode[0].engine.records) == 1
    assert group.decode[0].engine.records[0].fault is not None
    [continued] = [r.body for r in group.decode[1].engine.records]
    for leg in (prefills[1], continued):
        if api == "chat":
            assert leg["continue_final_message"] is True and leg["add_generation_prompt"] is False
            assert leg["messages"][:-1] == CHAT["messages"] and leg["messages"][-1]["role"] == "assistant"
            assert leg["messages"][-1]["content"] == " ".join(text_of(api, expected).split(" ")[:kept])
        else:
            assert leg["prompt"] == TEXT["prompt"] + " ".join(text_of(api, expected).split(" ")[:kept])
    assert continued["max_tokens"] == 24 - kept and continued["temperature"] == 0
    check_fresh_fields(mode, prefills, continued)
    gw.wait_for_metric('kimi_gateway_migrations_total{outcome="migrated",pool="pd"}', lambda v: v == 1)
    prompt = usage_of(expected)["prompt_tokens"]
    assert gw.wait_for_metric('kimi_gateway_tokens_total{kind="prompt",pool="pd"}', lambda v: v > 0) == prompt
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="pd"}') == 24
    assert gw.metric('kimi_gateway_migration_prefill_tokens_total{pool="pd"}') == prompt + kept
    entry = access_lines(caplog, gw)[-1]
    assert entry["migration"] == {"from": "pd/2", "to": "pd/3", "prefill": "pd/0", "outcome": "migrated",
                                  "kept_tokens": kept, "count": 1, "prefill_tokens": prompt + kept,
                                  "why": entry["migration"]["why"]}
    assert entry["outcome"] == "ok" and entry["worker"] == "pd/3" and entry["prefill_worker"] == "pd/0"
    gw.wait_until_idle()
    assert gw.metric("kimi_gateway_in_flight{") == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_pd_stream_whose_decode_worker_dies_goes_on_on_a_fresh_pair(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture, mode: str,
        fault: str) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    group, gw = setup(start_sim, start_gateway, mode, FAULTS[fault])
    run_and_check(start_sim, group, gw, mode, "chat", caplog)


@pytest.mark.parametrize("mode", MODES)
def test_a_pd_text_completion_goes_on_on_a_fresh_pair(start_sim: StartSim, start_gateway: StartGateway,
                                                      caplog: pytest.LogCaptureFixture, mode: str) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    group, gw = setup(start_sim, start_gateway, mode, FAULTS["eof"])
    run_and_check(start_sim, group, gw, mode, "completions", caplog)


@pytest.mark.parametrize("mode", ["sglang", "vllm-nixl"])
def test_a_prefill_worker_out_of_service_is_not_reused(start_sim: StartSim, start_gateway: StartGateway,
                                                       mode: str) -> None:
    # The stream's prefill worker (pd/0) is drained while its decode worker streams; when the
    # decode worker then dies, the fresh pair takes the other prefill worker (pd/1).
    group = pd_group(start_sim, mode, prefill=2, decode=2, tpot_s=0.02)
    group.decode[0].engine.set_faults(SimFaults(reset_after_chunks=12))
    gw = start_gateway([group.pool(disaggregation={"decode_policy": "round_robin",
                                                   "prefill_policy": "round_robin"})],
                       health=HEALTH, timeouts=TIMEOUTS)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT, timeout=15) as response:
        assert response.headers["x-kimi-gateway-prefill-worker"] == "pd/0"
        assert response.headers["x-kimi-gateway-decode-worker"] == "pd/2"
        raw = response.iter_raw()
        first = next(raw)
        assert httpx.post(gw.url + "/admin/workers/pd/0/drain", timeout=5).json()["draining"] is True
        events = [e for e in (first + b"".join(raw)).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(text_of("chat", events).split(" ")) == 24
    assert [e for e in events if e.startswith(SEAM)] == [
        b": x-kimi-gateway-migrated from=pd/2 to=pd/3 prefill=pd/1 kept_tokens=11"]
    assert len(group.prefill[0].engine.records) == 1 and len(group.prefill[1].engine.records) == 1
    assert group.prefill[1].engine.records[0].body["continue_final_message"] is True


def test_a_nixl_stream_committed_before_its_decode_leg_opened_migrates_too(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # The prefill legs outlast the hold window, so both the first stream and its continuation are
    # committed before their decode legs open (keep-alives meanwhile: `dispatch/pd/deferred.py`).
    mode = "vllm-nixl"
    group = PdGroup(mode, [start_sim("vllm", pd_role="prefill", pd_protocol=mode, ttft_s=0.4)],
                    [start_sim("vllm", pd_role="decode", pd_protocol=mode) for _ in range(2)])
    group.decode[0].engine.set_faults(FAULTS["reset"])
    gw = start_gateway([group.pool(disaggregation={"decode_policy": "round_robin"})], health=HEALTH,
                       timeouts={**TIMEOUTS, "hold_headers": 0.1, "keepalive_interval": 0.1})
    expected = reference(start_sim, mode, "chat")
    response, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert response.status_code == 200
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events), events
    assert b": keep-alive" in events  # committed before its first content
    assert text_of("chat", events) == text_of("chat", expected)
    assert usage_of(events) == usage_of(expected)
    assert [e for e in events if e.startswith(SEAM)] == [
        b": x-kimi-gateway-migrated from=pd/1 to=pd/2 prefill=pd/0 kept_tokens=7"]
    assert len(group.prefill[0].engine.records) == 2 and len(group.decode[1].engine.records) == 1
    gw.wait_until_idle()


def test_a_pd_pool_with_migrate_off_keeps_the_error_event(start_sim: StartSim, start_gateway: StartGateway,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    group, gw = setup(start_sim, start_gateway, "sglang", FAULTS["eof"], pool={"migrate": False})
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
    assert not any(e.startswith(SEAM) for e in events)
    assert group.decode[1].engine.records == [] and len(group.prefill[0].engine.records) == 1
    assert group.prefill[1].engine.records == []
    assert gw.metric("kimi_gateway_migrations_total") == 0
    assert "migration" not in access_lines(caplog, gw)[-1]


def test_a_pd_stream_with_no_other_decode_worker_ends_with_the_error_event(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    group = pd_group(start_sim, "sglang", decode=1)
    group.decode[0].engine.set_faults(FAULTS["eof"])
    gw = start_gateway([group.pool()], health=HEALTH, timeouts=TIMEOUTS)
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
    assert len(group.prefill[0].engine.records) == 1  # no second prefill without a decode worker for it
    assert gw.wait_for_metric('kimi_gateway_migrations_total{outcome="no_worker",pool="pd"}', lambda v: v == 1)
