"""The access log: one JSON line per request, with the incoming X-Request-ID, and no prompt text."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import httpx
import pytest

from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
SECRET_PROMPT = "the launch code is 7-alpha-unicorn"


def test_one_json_line_per_request_with_the_callers_request_id(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4,
            "stream": True}
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers={"x-request-id": "trace-42"}) as r:
        assert r.headers["x-request-id"] == "trace-42"
        assert b"[DONE]" in b"".join(r.iter_raw())
    engine_id = sim.engine.records[-1].headers["x-request-id"]  # the engine gets the gateway's own id
    assert re.fullmatch("[0-9a-f]{32}-1", engine_id)  # per request, then the attempt
    bad = httpx.post(gw.v1 + "/chat/completions", json={**body, "max_tokens": -1})
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32  # minted when none came

    ok, refused = access_lines(caplog, gw, 2)
    assert ok["request_id"] == "trace-42" and f'{ok["engine_request_id"]}-1' == engine_id
    assert "engine_request_id" not in refused  # it reached no engine
    assert (ok["pool"], ok["worker"], ok["status"], ok["attempts"]) == ("p", "p/0", 200, 1)
    assert ok["reason"] == r.headers["x-kimi-gateway-route-reason"] and ok["outcome"] == "ok" and ok["stream"] is True
    assert 0 < ok["ttft_s"] <= ok["duration_s"]
    assert ok["usage"]["completion_tokens"] == 4 and ok["estimated_prompt_tokens"] > 0
    assert refused["request_id"] == bad.headers["x-request-id"] and refused["status"] == 400
    assert refused["outcome"] == "error" and refused["worker"] is None
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "unicorn" not in logged  # no prompt text by default
