"""Worker health: probes, outlier ejection with back-off and half-open re-admission, 429 back-off."""

from __future__ import annotations

from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, **health: object) -> WorkerRegistry:
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 1000,
                                      "workers": ["http://a:1", "http://b:1"]}],
                           "health": {"passive_failures": 3, "ejection_base": 5, "ejection_max": 30, **health}},
                          environ={})
    return WorkerRegistry(config, clock=clock)


def ids(reg: WorkerRegistry) -> list[int]:
    return [w.index for w in reg.candidates("p")]


def test_consecutive_failures_eject_with_doubling_back_off_and_half_open() -> None:
    clock = Clock()
    reg = registry(clock)
    a = reg.pools["p"][0]
    for _ in range(2):
        reg.request_failed(a, "500")
    assert ids(reg) == [0, 1]                 # 2 failures: still in
    reg.request_failed(a, "500")
    assert ids(reg) == [1]                    # 3rd: ejected for 5 s
    clock.now += 5.01
    assert ids(reg) == [0, 1]                 # half-open
    reg.request_failed(a, "500")              # one failure re-ejects, for 10 s
    clock.now += 9.9
    assert ids(reg) == [1]
    clock.now += 0.2
    reg.request_failed(a, "500")              # again: 20 s
    clock.now += 19.9
    assert ids(reg) == [1]
    clock.now += 0.2
    reg.request_succeeded(a)                  # closed: the back-off starts over
    for _ in range(3):
        reg.request_failed(a, "500")
    clock.now += 5.01
    assert ids(reg) == [0, 1]


def test_ejection_is_capped() -> None:
    clock = Clock()
    reg = registry(clock, passive_failures=1)
    a = reg.pools["p"][0]
    for _ in range(8):
        reg.request_failed(a, "500")
        clock.now = a.ejected_until
    assert a.ejected_until - clock.now <= 30
    reg.request_failed(a, "500")
    assert a.ejected_until - clock.now == 30


def test_success_between_failures_resets_the_streak() -> None:
    reg = registry(Clock())
    a = reg.pools["p"][0]
    for _ in range(10):
        reg.request_failed(a, "500")
        reg.request_failed(a, "500")
        reg.request_succeeded(a)
    assert ids(reg) == [0, 1]


def test_probe_verdicts_and_refused_connections() -> None:
    reg = registry(Clock(), unhealthy_after=2)
    a = reg.pools["p"][0]
    reg.probe_failed(a, "timeout")
    assert ids(reg) == [0, 1]
    reg.probe_failed(a, "timeout")
    assert ids(reg) == [1] and reg.unready_pools() == []
    reg.probe_passed(a)
    assert ids(reg) == [0, 1]
    reg.connect_failed(a, "refused")
    reg.connect_failed(reg.pools["p"][1], "refused")
    assert ids(reg) == [] and reg.unready_pools() == ["p"]


def test_a_passing_probe_does_not_end_an_ejection() -> None:
    reg = registry(Clock(), passive_failures=1)
    a = reg.pools["p"][0]
    reg.request_failed(a, "500")
    reg.probe_passed(a)
    assert ids(reg) == [1]


def test_429_keeps_the_worker_out_for_retry_after() -> None:
    clock = Clock()
    reg = registry(clock)
    a = reg.pools["p"][0]
    reg.throttled(a, 3.0)
    assert ids(reg) == [1]
    clock.now += 3.01
    assert ids(reg) == [0, 1]
    reg.throttled(a, None)                    # no header: 1 s
    clock.now += 1.01
    assert ids(reg) == [0, 1]
    assert a.consecutive_failures == 0        # busy is not broken
