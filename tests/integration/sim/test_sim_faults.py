"""Fault injection of the simulator over real HTTP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.sim import SimFaults
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello world"}]


def test_fail_status_counts_down_then_serves(start_sim: StartSim) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + "/sim/faults", json={"fail_status": 503, "fail_count": 2})
    assert resp.status_code == 200 and resp.json()["fail_count"] == 2
    statuses = [httpx.post(srv.url + CHAT, json={"messages": HELLO, "stream": True}).status_code
                for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert httpx.get(srv.url + "/sim/faults").json()["fail_count"] == 0
    failed = srv.app.engine.records[0]
    assert failed.status == 503 and failed.fault == "fail_status" and failed.completed
    assert srv.app.engine.stats().prompt_tokens_total == 7  # only the served request was prefilled


def test_fail_status_default_body_is_engine_shaped(start_sim: StartSim) -> None:
    srv = start_sim(faults={"fail_status": 503})
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO})
    assert resp.status_code == 503
    assert resp.json() == {"error": {"message": "Simulated failure (HTTP 503).", "type": "ServiceUnavailableError",
                                     "param": None, "code": 503}}
    sglang = start_sim(engine="sglang", faults={"fail_status": 500})
    assert httpx.post(sglang.url + CHAT, json={"messages": HELLO}).json()["object"] == "error"


def test_429_with_retry_after_and_custom_body(start_sim: StartSim) -> None:
    body = '{"error": {"message": "slow down", "code": 429}}'
    srv = start_sim(faults={"fail_status": 429, "retry_after_s": 7, "fail_body": body})
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO})
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "7"
    assert resp.text == body


def test_per_request_faults_override_global(start_sim: StartSim) -> None:
    srv = start_sim(faults={"fail_status": 503})
    forced_ok = httpx.post(srv.url + CHAT, json={"messages": HELLO, "x_sim_faults": {"fail_status": None}})
    assert forced_ok.status_code == 200
    assert httpx.post(srv.url + CHAT, json={"messages": HELLO}).status_code == 503
    httpx.post(srv.url + "/sim/faults", json={})
    one_off = {"messages": HELLO, "x_sim_faults": {"fail_status": 500, "retry_after_s": 1}}
    resp = httpx.post(srv.url + CHAT, json=one_off)
    assert resp.status_code == 500 and resp.headers["retry-after"] == "1"
    assert httpx.post(srv.url + CHAT, json={"messages": HELLO}).status_code == 200
    assert srv.app.engine.records[2].body["x_sim_faults"] == {"fail_status": 500, "retry_after_s": 1}


def test_invalid_faults_are_rejected(start_sim: StartSim) -> None:
    srv = start_sim()
    resp = httpx.post(srv.url + CHAT, json={"messages": HELLO, "x_sim_faults": {"bogus": 1}})
    assert resp.status_code == 400 and "x_sim_faults" in resp.json()["error"]["message"]
    assert httpx.post(srv.url + "/sim/faults", json={"fail_status": "x"}).status_code == 422
    assert httpx.post(srv.url + "/sim/faults", json={"raw_stream_chunks": ["%%%"]}).status_code == 422


@pytest.mark.parametrize("stream", [False, True])
def test_hang_before_headers_is_recorded_as_aborted(start_sim: StartSim, stream: bool) -> None:
    srv = start_sim(faults={"hang_before_headers": True})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json={"messages": HELLO, "stream": stream}, timeout=0.3)
    engine = srv.app.engine
    record = engine.wait_for(lambda: engine.records[0] if engine.records[0].aborted else None, timeout=2)
    assert record.status is None and record.headers_at is None and not record.completed
    assert record.fault == "hang_before_headers"


def test_hang_health(start_sim: StartSim) -> None:
    srv = start_sim(faults={"hang_health": True})
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(srv.url + "/health", timeout=0.3)
    assert httpx.get(srv.url + "/v1/models").status_code == 200
    httpx.post(srv.url + "/sim/faults", json={})
    assert httpx.get(srv.url + "/health").status_code == 200


def test_drop_after_chunks_gives_the_client_an_error(start_sim: StartSim,
                                                     sse_payloads: Callable[[bytes], list[Any]]) -> None:
    srv = start_sim(faults={"drop_after_chunks": 3})
    received = b""
    with pytest.raises(httpx.RemoteProtocolError), \
            httpx.stream("POST", srv.url + CHAT, json={"messages": HELLO, "max_tokens": 10, "stream": True}) as resp:
        assert resp.status_code == 200
        for piece in resp.iter_raw():
            received += piece
    events = sse_payloads(received)
    assert len(events) == 3 and "[DONE]" not in events
    record = srv.app.engine.records[0]
    assert record.fault == "drop_after_chunks" and not record.completed and not record.aborted
    assert srv.app.engine.stats().running == 0
    # a non-streaming request is not affected
    assert httpx.post(srv.url + CHAT, json={"messages": HELLO}).status_code == 200


def test_raw_stream_chunks_come_out_byte_exact(start_sim: StartSim) -> None:
    tokyo = "東京".encode()
    chunks = [b'data: {"choices":[{"delta":{"content":"', tokyo[:2], tokyo[2:] + b'"}}]}\n', b"\ndata: [DONE]\n\n"]
    srv = start_sim()
    body = {"messages": HELLO, "stream": True, "x_sim_faults": {"raw_stream_chunks": SimFaults.encode_chunks(chunks)}}
    pieces: list[bytes] = []
    with httpx.stream("POST", srv.url + CHAT, json=body) as resp:
        assert resp.status_code == 200
        pieces.extend(resp.iter_raw())
    assert b"".join(pieces) == b"".join(chunks)
    assert pieces == chunks  # one write each (~20 ms apart), so the client reads them apart
    assert srv.app.engine.records[0].fault == "raw_stream_chunks"
