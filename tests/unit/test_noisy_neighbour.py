"""The noisy-neighbour benchmark's pure parts (loadtest/noisy_neighbour.py): its gateway config is
one the gateway accepts, B's percentiles count unfinished requests, the arrivals are Poisson."""

from __future__ import annotations

import random

from gateway.config import parse_config
from loadtest.noisy_neighbour import ScenarioResult, Settings, censored_percentile, gateway_config, poisson, table


def test_the_benchmarks_gateway_config_is_valid_with_flow_control_on_and_off() -> None:
    keys = {"a": "sk-a-" + "x" * 40, "b": "sk-b-" + "y" * 40}
    on = parse_config(gateway_config(Settings(), 8000, ["http://127.0.0.1:9"], keys, flow=True, b_band=1), environ={})
    assert on.pools[0].flow_control.enabled and on.pools[0].flow_control.max_waiting == Settings.max_waiting
    assert [k.priority for k in on.auth.keys] == [0, 1]
    off = parse_config(gateway_config(Settings(), 8000, ["http://127.0.0.1:9"], keys, flow=False), environ={})
    assert not off.pools[0].flow_control.enabled


def test_unfinished_requests_count_above_the_run() -> None:
    assert censored_percentile([1.0, 2.0, 3.0, 4.0], 0, 50, 60) == (2.5, False)
    assert censored_percentile([1.0] * 99, 1, 99, 60) == (1.0, False)
    assert censored_percentile([1.0] * 98, 2, 99, 60) == (60, True)
    assert censored_percentile([], 3, 50, 60) == (60, True)
    assert censored_percentile([], 0, 50, 60) == (None, False)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = poisson(10.0, 100.0, random.Random(1))
    assert 900 < len(times) < 1100 and times == sorted(times) and times[-1] < 100


def test_the_table_marks_censored_percentiles() -> None:
    alone = ScenarioResult("alone", b_sent=10, b_ok=10, b_ttft_p50_s=1.0, b_ttft_p99_s=2.0)
    off = ScenarioResult("off", b_sent=10, b_unfinished=8, b_ttft_p50_s=55.0, b_ttft_p50_censored=True,
                         b_ttft_p99_s=55.0, b_ttft_p99_censored=True)
    text = table([alone, off], alone)
    assert "| alone | 10 | 0 | 1.00 | 2.00 | 1.00x |" in text and "| off | 10 | 8 | >55.00 | >55.00 | >27.50x |" in text
