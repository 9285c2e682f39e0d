"""The simulator notices clients that hang up, at every stage, and frees the load they held."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import httpx
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _aborted(srv: RunningSim) -> None:
    engine = srv.app.engine
    engine.wait_for(lambda: engine.records and engine.records[-1].aborted, timeout=2)
    engine.wait_for(lambda: engine.stats().running == 0, timeout=2)
    assert engine.stats().finished_by_reason == {"abort": 1}
    assert not engine.records[-1].completed


def test_client_gives_up_during_prefill_non_streaming(start_sim: StartSim) -> None:
    srv = start_sim(ttft_s=5.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json={"messages": HELLO}, timeout=0.3)
    _aborted(srv)
    assert srv.app.engine.records[-1].status is None


def test_client_leaves_during_prefill_after_stream_headers(start_sim: StartSim) -> None:
    srv = start_sim(ttft_s=5.0)
    with httpx.stream("POST", srv.url + CHAT, json={"messages": HELLO, "stream": True}) as resp:
        assert resp.status_code == 200  # headers came at once; the first event would take 5 s
    _aborted(srv)
    assert srv.app.engine.records[-1].first_byte_at is None


def test_client_closes_mid_stream(start_sim: StartSim) -> None:
    srv = start_sim(tpot_s=0.02)
    with httpx.stream("POST", srv.url + CHAT, json={"messages": HELLO, "max_tokens": 500, "stream": True}) as resp:
        data: list[str] = []
        for line in resp.iter_lines():
            if line.startswith("data:"):
                data.append(line)
            if len(data) == 4:
                break
    _aborted(srv)
    record = srv.app.engine.records[-1]
    assert 3 <= record.completion_tokens_sent < 50
    assert srv.app.engine.stats().generation_tokens_total < 50


def test_client_leaves_while_waiting_for_admission(start_sim: StartSim) -> None:
    srv = start_sim(ttft_s=1.0, max_num_seqs=1)
    engine = srv.app.engine
    with httpx.stream("POST", srv.url + CHAT, json={"messages": HELLO, "stream": True}):
        engine.wait_for(lambda: engine.stats().running == 1, timeout=2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + CHAT, json={"messages": HELLO}, timeout=0.3)
        engine.wait_for(lambda: len(engine.records) == 2 and engine.records[1].aborted, timeout=2)
        assert engine.stats().waiting == 0 and engine.stats().running == 1
    engine.wait_for(lambda: engine.stats().running == 0, timeout=2)


@pytest.mark.anyio
async def test_async_client_cancel_mid_stream(start_sim: StartSim) -> None:
    srv = start_sim(tpot_s=0.02)
    engine = srv.app.engine
    async with httpx.AsyncClient(base_url=srv.url) as client:
        with anyio.move_on_after(0.2):
            async with client.stream("POST", CHAT, json={"messages": HELLO, "max_tokens": 500,
                                                         "stream": True}) as resp:
                async for _ in resp.aiter_raw():
                    pass
    await engine.async_wait_for(lambda: engine.records and engine.records[-1].aborted, timeout=2)
    assert engine.records[-1].completion_tokens_sent < 100
