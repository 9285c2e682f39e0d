"""The simulator's compact timing records (`GET /sim/timings`, gateway/sim/timings.py) over real
HTTP: the client's id and tag, queueing vs prefill times on both schedulers, the bound, clearing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
CHAT = "/v1/chat/completions"


def _timings(url: str, count: int) -> dict[str, Any]:
    """`GET /sim/timings` once it lists `count` requests (a timing is kept when the handler ends,
    just after the client has read the answer's last byte)."""
    deadline = time.monotonic() + 5
    while len((got := httpx.get(url + "/sim/timings").json())["timings"]) < count:
        assert time.monotonic() < deadline, got
        time.sleep(0.005)
    return got


def _post(url: str, text: str, rid: str, tag: str | None = None, max_tokens: int = 1) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "stream": True}
    if tag is not None:
        body["x_request_tag"] = tag
    with httpx.stream("POST", url + CHAT, json=body, headers={"x-request-id": rid}, timeout=10) as resp:
        assert resp.status_code == 200
        resp.read()


@pytest.mark.parametrize("scheduler", ["stepped", "per_request"])
def test_timings_split_queueing_from_prefill(start_sim: StartSim, scheduler: str) -> None:
    """With one slot, the second request waits for the first to finish: its queueing
    (admitted - received) covers the first's prefill; each prefill (first byte - admitted) is its
    own uncached tokens / the prefill rate."""
    srv = start_sim(engine="sglang", kv_capacity_tokens=100_000, prefill_tokens_per_s=20_000, ttft_s=0.0,
                    tpot_s=0.001, max_num_seqs=1, scheduler=scheduler, timing_records=10, keep_records=False,
                    chunk_tokens=100_000, decode_step_s=0.001)
    long_text = "a" * 16_000  # 4,000 tokens (+4 for the message): 0.2 s of prefill at 20k/s
    first = threading.Thread(target=_post, args=(srv.url, long_text, "r-1", "tag-1"))
    first.start()
    deadline = time.monotonic() + 5
    while httpx.get(srv.url + "/sim/stats").json()["max_running"] < 1:  # the first one runs
        assert time.monotonic() < deadline
        time.sleep(0.005)
    _post(srv.url, "b" * 400, "r-2")  # 104 tokens: ~5 ms of prefill, once the first one is done
    first.join()
    got = _timings(srv.url, 2)
    assert (got["capacity"], got["dropped"]) == (10, 0)
    by_id = {t["request_id"]: t for t in got["timings"]}
    one, two = by_id["r-1"], by_id["r-2"]
    assert (one["tag"], two["tag"]) == ("tag-1", None)
    assert (one["prompt_tokens"], one["cached_tokens"], one["prefill_tokens"]) == (4004, 0, 4004)
    for t in (one, two):
        assert t["received_at"] <= t["admitted_at"] <= t["first_byte_at"] <= t["finished_at"]
        assert t["status"] == 200 and not t["aborted"] and t["path"] == CHAT
    assert one["first_byte_at"] - one["admitted_at"] == pytest.approx(0.2, abs=0.08)
    assert one["admitted_at"] - one["received_at"] < 0.05  # nobody ahead of it
    assert two["admitted_at"] >= one["admitted_at"] + 0.15  # one slot: it waited for the first's prefill
    assert two["admitted_at"] - two["received_at"] > 0.1
    assert two["first_byte_at"] - two["admitted_at"] < 0.08
    assert httpx.get(srv.url + "/sim/requests").json() == []  # no bodies kept


def test_timings_are_bounded_and_cleared(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang", timing_records=2)
    for i in range(3):
        _post(srv.url, f"hello {i}", f"r-{i}", f"t-{i}")
        _timings(srv.url, min(i + 1, 2))
    deadline = time.monotonic() + 5
    while (got := httpx.get(srv.url + "/sim/timings").json())["dropped"] < 1:  # the third one is in
        assert time.monotonic() < deadline, got
        time.sleep(0.005)
    assert (got["capacity"], got["dropped"]) == (2, 1)
    assert [t["tag"] for t in got["timings"]] == ["t-1", "t-2"]  # oldest first, the first one dropped
    assert httpx.delete(srv.url + "/sim/timings").json() == {"cleared": 2}
    assert httpx.get(srv.url + "/sim/timings").json() == {"capacity": 2, "dropped": 0, "timings": []}


def test_no_timings_by_default(start_sim: StartSim) -> None:
    srv = start_sim(engine="sglang")
    _post(srv.url, "hello", "r-0")
    assert httpx.get(srv.url + "/sim/timings").json() == {"capacity": 0, "dropped": 0, "timings": []}
    assert srv.app.engine.records[0].admitted_at is not None  # the full record has it too
