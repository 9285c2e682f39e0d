"""The trace replay's harness pieces (loadtest/): medians and spread, run order, the peers' flag
mapping and the utilisation -> speed-up model. No processes are started here; the replay itself is
a benchmark (`python -m loadtest.replay --quick`)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from loadtest.capacity import (
    Workload,
    prefill_for_utilisation,
    service_seconds,
    speedup_for_utilisation,
    utilisation,
    worker_capacity_rps,
)
from loadtest.peers import ROUTERS, Peer, parse_peer, peer_settings
from loadtest.plan import Level, rotated, run_order
from loadtest.replay import build_parser, plan_levels, settings_from
from loadtest.replay_settings import window
from loadtest.report import RunResult, check_served, summary_row
from loadtest.spread import aggregate, fmt_spread, spread
from loadtest.trace import read_trace, schedule

# --- median and spread -------------------------------------------------------------------------------------


def test_spread_is_median_min_max_of_the_measured_values() -> None:
    got = spread([0.30, None, 0.10, 0.25])
    assert got is not None
    assert (got.median, got.low, got.high, got.n) == (0.25, 0.10, 0.30, 3)
    assert got.values == (0.30, 0.10, 0.25)  # run order kept
    even = spread([4.0, 1.0, 3.0, 2.0])
    assert even is not None and even.median == 2.5
    assert spread([None, None]) is None
    assert spread([]) is None


def test_fmt_spread_shows_the_range_only_when_there_is_one() -> None:
    assert fmt_spread(spread([0.2531, 0.2498, 0.2560]), ".3f") == "0.253 (0.250-0.256)"
    assert fmt_spread(spread([1.5]), ".2f") == "1.50"
    assert fmt_spread(spread([2.0, 2.0]), ".1f") == "2.0"
    assert fmt_spread(None, ".3f") == "-"


def _run(name: str, level: str, status: str = "ok", **figures: float) -> RunResult:
    run = RunResult(name, "gateway", status=status, level=level)
    for key, value in figures.items():
        setattr(run, key, value)
    return run


def test_aggregate_groups_by_level_and_layout_and_skips_failed_runs() -> None:
    runs = [
        _run("prefix_affinity", "80%", hit_ratio=0.25, ttft_p99_s=2.0),
        _run("least_load", "80%", hit_ratio=0.07, ttft_p99_s=2.4),
        _run("prefix_affinity", "90%", hit_ratio=0.24, ttft_p99_s=3.0),
        _run("prefix_affinity", "80%", hit_ratio=0.27, ttft_p99_s=1.0),
        _run("prefix_affinity", "80%", status="failed: workers exited", hit_ratio=0.99),
        _run("prefix_affinity", "80%", hit_ratio=0.26, ttft_p99_s=4.0),
    ]
    cells = aggregate(runs)
    assert [(c.level, c.name) for c in cells] == [("80%", "prefix_affinity"), ("80%", "least_load"),
                                                  ("90%", "prefix_affinity")]
    first = cells[0]
    assert (first.runs, first.ok_runs) == (4, 3)
    hit, p99 = first.figures["hit_ratio"], first.figures["ttft_p99_s"]
    assert hit is not None and (hit.median, hit.low, hit.high) == (0.26, 0.25, 0.27)
    assert p99 is not None and (p99.median, p99.low, p99.high) == (2.0, 1.0, 4.0)
    row = summary_row(first)
    assert "| 80% | prefix_affinity | 0.260 (0.250-0.270) |" in row and row.endswith("| 3/4 |")


def test_a_cell_without_an_ok_run_shows_its_status() -> None:
    cells = aggregate([_run("vllm-router:cache_aware", "20x", status="skipped: not installed")])
    assert cells[0].ok_runs == 0 and all(v is None for v in cells[0].figures.values())
    assert "skipped: not installed" in summary_row(cells[0])


def test_a_run_whose_workers_did_not_see_the_load_is_failed() -> None:
    # seen on a shared machine: the gateway could not bind its port and another process's
    # gateway answered the load generator instead
    foreign = RunResult("prefix_affinity", "gateway", ok=188)
    check_served(foreign, 0.0)
    assert foreign.status.startswith("failed: the workers counted 0 of 188")
    retried = RunResult("sglang-router:cache_aware", "peer", ok=1750)
    check_served(retried, 1_760.0)  # retries make the workers count more, never fewer
    assert retried.status == "ok"
    unknown = RunResult("least_load", "gateway", ok=10)
    check_served(unknown, None)
    assert unknown.status == "ok"


# --- run order -------------------------------------------------------------------------------------------


def test_rotated_starts_at_the_index_and_wraps() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert rotated([], 3) == []


def test_each_repetition_starts_with_another_layout_and_every_run_happens_once() -> None:
    order = run_order(layouts=4, levels=2, repeats=4)
    assert len(order) == 4 * 2 * 4
    assert len({(s.repeat, s.level, s.layout) for s in order}) == len(order)
    firsts = {}
    for slot in order:
        firsts.setdefault((slot.repeat, slot.level), slot.layout)
    for level in range(2):
        assert sorted(firsts[(rep, level)] for rep in range(4)) == [0, 1, 2, 3]
    # repetitions are outermost: all of repetition 0 runs before any of repetition 1
    reps = [s.repeat for s in order]
    assert reps == sorted(reps)
    assert run_order(3, 1, 0) == []
    with pytest.raises(ValueError):
        run_order(-1, 1, 1)


# --- the peers' flags ------------------------------------------------------------------------------------


def test_peer_names_parse_with_sglang_as_the_default_router() -> None:
    assert parse_peer("cache_aware") == Peer("sglang-router", "cache_aware")
    assert parse_peer("vllm-router:kv_aware") == Peer("vllm-router", "kv_aware")
    with pytest.raises(ValueError, match="unknown peer router"):
        parse_peer("litellm:cache_aware")
    with pytest.raises(ValueError, match="no policy"):
        parse_peer("sglang-router:kv_aware")


def test_eviction_interval_keeps_its_trace_time_and_tree_size_matches_the_worker_cache() -> None:
    sglang, vllm = Peer("sglang-router", "cache_aware"), Peer("vllm-router", "cache_aware")
    got = peer_settings(sglang, 20.0, 1_000_000, 4.0, defaults=(60, 2**26))
    assert got.flags == ["--eviction-interval-secs", "3", "--max-tree-size", "4000000"]
    assert peer_settings(vllm, 20.0, 1_000_000, 4.0, defaults=(120, 2**25)).flags[1] == "6"
    assert peer_settings(vllm, 8.0, 250_000, 4.0, defaults=(120, 2**25)).flags == [
        "--eviction-interval-secs", "15", "--max-tree-size", "1000000"]
    # whole seconds, never 0 (0 turns the routers' eviction off)
    assert peer_settings(sglang, 1000.0, 1_000_000, 4.0, defaults=(60, 2**26)).flags[1] == "1"
    unscaled = peer_settings(sglang, 20.0, 1_000_000, 4.0, scale=False, defaults=(60, 2**26))
    assert unscaled.flags == [] and "not scaled" in unscaled.mapping["--eviction-interval-secs"]


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_the_installed_router_takes_the_scaled_flags(router: str) -> None:
    spec = ROUTERS[router]
    try:
        launch = importlib.import_module(f"{spec.module}.launch_router")
    except ImportError:
        if os.environ.get("CI"):  # .ci/run installs both routers: there a skip would prove nothing
            raise
        pytest.skip(f"{spec.dist} is not installed")
    flags = peer_settings(Peer(router, "cache_aware"), 20.0, 1_000_000, 4.0).flags
    args = launch.parse_router_args(["--worker-urls", "http://127.0.0.1:1", "--policy", "cache_aware", *flags])
    defaults = importlib.import_module(f"{spec.module}.router_args").RouterArgs
    assert args.eviction_interval_secs == max(1, round(defaults.eviction_interval_secs / 20.0))
    assert args.max_tree_size == 4_000_000


# --- utilisation -----------------------------------------------------------------------------------------

LOAD = Workload(requests=7_851, span_s_1x=2_400.0, mean_prompt_tokens=12_430.0, mean_output_tokens=17.0)
SIM = {"max_num_seqs": 4, "ttft_s": 0.01, "tpot_s": 0.005, "prefill_tokens_per_s": 20_000.0}


def test_capacity_follows_the_simulator_settings() -> None:
    seconds = 0.01 + 12_430.0 / 20_000.0 + 17.0 * 0.005
    assert service_seconds(SIM, LOAD) == pytest.approx(seconds)
    assert worker_capacity_rps(SIM, LOAD) == pytest.approx(4 / seconds)
    slower_decode = {**SIM, "decode_batch_slowdown": 0.5}
    assert service_seconds(slower_decode, LOAD) == pytest.approx(seconds + 17.0 * 0.005 * 1.5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        worker_capacity_rps({**SIM, "max_num_seqs": None}, LOAD)


@pytest.mark.parametrize("target", [0.6, 0.8, 0.9])
def test_speedup_for_a_utilisation_offers_that_share_of_capacity(target: float) -> None:
    speedup = speedup_for_utilisation(target, SIM, LOAD, workers=8)
    assert utilisation(SIM, LOAD, 8, speedup) == pytest.approx(target)
    # by hand: arrivals per worker x slot-seconds per request / slots
    per_worker = LOAD.requests / LOAD.span_s_1x * speedup / 8
    assert per_worker * service_seconds(SIM, LOAD) / 4 == pytest.approx(target)


def test_prefill_for_a_utilisation_inverts_the_same_model() -> None:
    tps = prefill_for_utilisation(0.8, {k: v for k, v in SIM.items() if k != "prefill_tokens_per_s"}, LOAD, 8, 20.0)
    assert utilisation({**SIM, "prefill_tokens_per_s": tps}, LOAD, 8, 20.0) == pytest.approx(0.8, rel=1e-9)
    # the closed form of this model (the replay's former 'auto' rule)
    lam = LOAD.rate_1x * 20.0 / 8
    assert tps == pytest.approx(LOAD.mean_prompt_tokens / (0.8 * 4 / lam - 0.01 - 17.0 * 0.005), rel=1e-9)
    with pytest.raises(ValueError, match="fixed latency alone exceed"):
        prefill_for_utilisation(0.8, {**SIM, "tpot_s": 10.0}, LOAD, 8, 20.0)


def test_stepped_workers_share_one_prefill_budget() -> None:
    stepped = {"scheduler": "stepped", "prefill_tokens_per_s": 100_000.0, "chunk_tokens": 8_192,
               "decode_step_s": 0.005, "max_num_seqs": 256}
    busy = 12_430.0 / 100_000.0 + 12_430.0 / 8_192 * 0.005
    assert service_seconds(stepped, LOAD) == pytest.approx(busy)
    assert worker_capacity_rps(stepped, LOAD) == pytest.approx(1 / busy)  # not x 256 slots
    budget = prefill_for_utilisation(0.8, {k: v for k, v in stepped.items() if k != "prefill_tokens_per_s"},
                                     LOAD, 8, 20.0)
    # the closed form: lam x P / (u - lam x P / chunk x step)
    lam = LOAD.rate_1x * 20.0 / 8
    assert budget == pytest.approx(lam * 12_430.0 / (0.8 - lam * 12_430.0 / 8_192 * 0.005), rel=1e-9)
    assert utilisation({**stepped, "prefill_tokens_per_s": budget}, LOAD, 8, 20.0) == pytest.approx(0.8)


def test_load_levels_from_the_command_line(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--utilisation", "60%,0.8,0.9", "--repeat", "3", "--policies", "least_load",
                                      "--peers", "cache_aware,vllm-router:cache_aware",
                                      "--results-dir", str(tmp_path)])
    s = settings_from(args)
    assert s.utilisations == [0.6, 0.8, 0.9] and s.repeats == 3
    assert [p.name for p in s.peers] == ["sglang-router:cache_aware", "vllm-router:cache_aware"]
    levels = plan_levels(s, LOAD)
    assert [lv.label for lv in levels] == ["60%", "80%", "90%"]
    assert len({lv.prefill_tps for lv in levels}) == 1  # the same workers at every level
    # 'auto' prefill makes the workers --target-util (0.8) busy at --speedup (20): that level is 20x
    assert levels[1].speedup == pytest.approx(20.0)
    assert levels[0].speedup == pytest.approx(20.0 * 0.6 / 0.8)
    per_request = plan_levels(settings_from(build_parser().parse_args(
        ["--utilisation", "0.9", "--scheduler", "per_request"])), LOAD)
    assert per_request[0].speedup == pytest.approx(20.0 * 0.9 / 0.8)
    assert per_request[0].prefill_tps != levels[0].prefill_tps  # per slot, not per worker
    plain = plan_levels(settings_from(build_parser().parse_args(["--speedup", "12"])), LOAD)
    assert plain == [Level(None, 12.0, plain[0].prefill_tps)] and plain[0].label == "12x"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--utilisation", "0"])


def test_a_window_of_the_trace_starts_at_its_own_first_row(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [(0, 1), (59_999, 2), (60_000, 3), (61_500, 1), (120_000, 2)]  # (timestamp ms, blocks)
    trace.write_text("".join(
        f'{{"timestamp": {ts}, "input_length": {512 * n}, "output_length": 4, "hash_ids": {list(range(n))}}}\n'
        for ts, n in rows))
    held_out = read_trace(trace, minutes=2, from_minutes=1)
    assert [(r.index, r.timestamp_ms) for r in held_out] == [(0, 60_000), (1, 61_500)]
    assert [item.send_at_s for item in schedule(held_out, speedup=2.0)] == [0.0, 0.75]
    assert [r.timestamp_ms for r in read_trace(trace, minutes=1)] == [0, 59_999]
    s = settings_from(build_parser().parse_args(["--from-minutes", "40", "--minutes", "60"]))
    assert (s.from_minutes, s.minutes, window(s)) == (40.0, 60.0, "minutes 40-60")
    with pytest.raises(SystemExit):
        settings_from(build_parser().parse_args(["--from-minutes", "40", "--minutes", "40"]))
