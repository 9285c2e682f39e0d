"""The TTFT split of the replay (loadtest/ttft_split.py): joining the client's results with the
workers' timings, the per-run summary, and the split of a TTFT gap into choices and router time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from loadtest.loadgen import RequestResult
from loadtest.ttft_split import RequestSplit, gap_split, join, split_section, summarize


def _result(i: int, sent_at: float, ttft: float, ok: bool = True) -> RequestResult:
    return RequestResult(i, 0.0, request_id=f"replay-{i}", sent_s=0.0, sent_at=sent_at, ttft_s=ttft,
                         e2e_s=ttft + 0.1 if ok else None, error=None if ok else "HTTP 503: busy")


def _timing(rid: str | None, tag: str | None, received: float, admitted: float | None, first_byte: float | None,
            prompt: int = 1000, cached: int = 400) -> dict[str, Any]:
    return {"request_id": rid, "tag": tag, "received_at": received, "admitted_at": admitted,
            "first_byte_at": first_byte, "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens": prompt - cached}


def test_join_by_header_or_tag_splits_the_ttft_exactly() -> None:
    results = [_result(0, 100.0, 0.5), _result(1, 200.0, 0.3)]
    workers = [
        [_timing("replay-0", None, 100.01, 100.11, 100.45)],  # a peer router: the client's header
        [_timing("5f0c-1", "replay-1", 200.02, 200.03, 200.28, prompt=800, cached=0)],  # the gateway: the tag
    ]
    joined = join(results, workers)
    assert (joined.unmatched, joined.no_first_byte) == (0, 0)
    one, two = joined.splits
    assert (one.worker, two.worker) == (0, 1)
    assert one.router_in_s == pytest.approx(0.01) and one.queue_s == pytest.approx(0.1)
    assert one.prefill_s == pytest.approx(0.34) and one.relay_s == pytest.approx(0.05)
    for s in (one, two):
        assert s.router_in_s + (s.queue_s or 0) + (s.prefill_s or 0) + s.relay_s == pytest.approx(s.ttft_s)
        assert s.router_s + s.engine_s == pytest.approx(s.ttft_s)
    assert (two.prompt_tokens, two.cached_tokens, two.prefill_tokens) == (800, 0, 800)


def test_tpot_at_the_client_and_at_the_worker() -> None:
    long, short = _result(0, 100.0, 0.5), _result(1, 200.0, 0.3)
    long.completion_tokens, long.tpot_s = 11, 0.012  # the client's: first to last token / 10
    short.completion_tokens, short.tpot_s = 1, None
    workers = [[{**_timing(None, "replay-0", 100.01, 100.02, 100.45), "finished_at": 100.55},
                {**_timing(None, "replay-1", 200.01, 200.02, 200.25), "finished_at": 200.26}]]
    one, two = join([long, short], workers).splits
    assert one.tpot_s == 0.012 and one.engine_tpot_s == pytest.approx(0.01)  # (100.55 - 100.45) / 10
    assert two.tpot_s is None and two.engine_tpot_s is None  # one token: no time per token
    summary = summarize(join([long, short], workers), 2)
    assert summary["engine_tpot_s"]["p99"] == pytest.approx(0.01) and summary["tpot_s"]["p50"] == 0.012


def test_join_takes_the_attempt_that_answered_and_counts_what_it_cannot_join() -> None:
    results = [_result(0, 10.0, 1.0), _result(1, 20.0, 1.0), _result(2, 30.0, 1.0), _result(3, 40.0, 1.0, ok=False)]
    workers = [
        [_timing("gw-1", "replay-0", 10.01, None, None),  # the first attempt failed before any byte
         _timing(None, "replay-2", 30.1, None, None)],  # never answered
        [_timing("gw-2", "replay-0", 10.3, 10.2, 10.9)],  # the retry answered; admission out of order
    ]
    joined = join(results, workers)
    assert (len(joined.splits), joined.unmatched, joined.no_first_byte) == (1, 1, 1)  # replay-1: nowhere
    (split,) = joined.splits
    assert split.worker == 1 and split.router_in_s == pytest.approx(0.3)
    assert split.queue_s is None and split.prefill_s is None  # an admission before the body read is not trusted
    assert split.engine_s == pytest.approx(0.6)


def _splits(router: float, engines: list[float], tokens: int = 100) -> list[RequestSplit]:
    return [RequestSplit(i, 0, router + e, router / 2, e / 2, e / 2, router / 2, 1000, 1000 - tokens, tokens)
            for i, e in enumerate(engines)]


def test_gap_split_adds_up_and_names_the_router_and_the_choices() -> None:
    engines = [0.1, 0.2, 0.3, 0.4, 0.5]
    slow_router = _splits(0.02, engines, tokens=300)  # same choices, 20 ms of router time
    fast_router = _splits(0.0, engines, tokens=300)
    gap = gap_split(slow_router, fast_router, 50)
    assert gap is not None
    assert gap.gap_s == pytest.approx(0.02) and gap.router_s == pytest.approx(0.02)
    assert gap.choices_s == pytest.approx(0.0) and gap.prefill_tokens_mean_delta == 0
    worse_choices = _splits(0.0, [e * 2 for e in engines], tokens=500)
    gap = gap_split(worse_choices, fast_router, 50)
    assert gap is not None
    assert (gap.gap_s, gap.choices_s, gap.router_s) == pytest.approx((0.3, 0.3, 0.0))
    assert gap.prefill_tokens_mean_delta == 200
    mixed = _splits(0.01, [0.05, 0.3, 0.31, 0.9, 2.0])
    for q in (50, 99):
        gap = gap_split(mixed, fast_router, q)
        assert gap is not None
        assert gap.choices_s + gap.router_s == pytest.approx(gap.gap_s)
        assert sum(gap.mean_components.values()) == pytest.approx(gap.mean_gap_s)
    assert gap_split([], fast_router) is None


def test_summary_percentiles_and_tokens() -> None:
    joined = join([_result(i, float(i), 0.1 * (i + 1)) for i in range(5)],
                  [[_timing(f"replay-{i}", None, i + 0.01, i + 0.02, i + 0.1 * (i + 1) - 0.01, cached=200 * i)
                    for i in range(5)]])
    summary = summarize(joined, completed=6)
    assert (summary["joined"], summary["completed"]) == (5, 6)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.3)
    assert summary["router_in_s"]["p50"] == pytest.approx(0.01)
    assert summary["queue_s"]["mean"] == pytest.approx(0.01)
    assert summary["prefill_tokens_mean"] == pytest.approx(1000 - 400)
    assert summary["cached_share"] == pytest.approx(0.4)


@dataclass
class _Run:
    name: str
    kind: str
    level: str
    repeat: int
    request_splits: list[RequestSplit]
    status: str = "ok"
    split: dict[str, Any] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    machine_busy: float | None = None
    send_lag_p99_s: float | None = None
    ok: int = 3


def test_section_compares_each_gateway_run_with_the_peers_of_its_level_and_repetition() -> None:
    def run(name: str, kind: str, level: str, repeat: int, router: float) -> _Run:
        splits = _splits(router, [0.1, 0.2, 0.3])
        from loadtest.ttft_split import JoinResult

        return _Run(name, kind, level, repeat, splits, split=summarize(JoinResult(splits), 3))

    gateway = run("prefix_affinity", "gateway", "80%", 0, 0.02)
    gateway.cpu_seconds, gateway.machine_busy, gateway.send_lag_p99_s = {"loadgen": 9.0, "gateway": 0.03}, 0.95, 0.5
    runs = [gateway, run("sglang-router:cache_aware", "peer", "80%", 0, 0.0),
            run("ttft_cost", "gateway", "80%", 1, 0.02), run("pd", "pd", "80%", 0, 0.0),
            run("sglang-router:cache_aware", "peer", "60%", 0, 0.0)]
    text, data = split_section(runs)  # type: ignore[arg-type]
    assert [(g["layout"], g["peer"], g["level"]) for g in data["gaps"]] == [
        ("prefix_affinity", "sglang-router:cache_aware", "80%")]  # ttft_cost's repetition has no peer run
    assert data["gaps"][0]["p50"]["router_s"] == pytest.approx(0.02)
    assert len(data["runs"]) == 4  # the PD run is not split
    assert "| 80% | 1 | prefix_affinity vs sglang-router:cache_aware | +20 | +0 | +20 |" in text
    assert "| 0.900 | 10.0 | 95% (saturated) | 0.50 |" in text  # cached share, router CPU per request, flags
    assert data["runs"][0]["router_cpu_ms_per_request"] == pytest.approx(10.0)
