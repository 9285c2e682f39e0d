"""Each worker's room and the pool's (gateway/flow/saturation.py): the engines' scraped waiting
requests and KV usage plus this replica's requests not yet started."""

from __future__ import annotations

import time

from gateway.backends.capacity import PoolGate
from gateway.backends.engine_kinds import ENGINES
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.flow.params import PoolFlowConfig
from gateway.flow.saturation import Starts, StartTicket, pool_room, worker_room

FLOW = PoolFlowConfig(enabled=True, max_waiting=2, max_kv_usage=0.9, max_prefill_tokens=None)


def worker(i: int = 0, waiting: float | None = 0.0, kv: float | None = 0.1, scraped_at: float = 0.0) -> Worker:
    w = Worker("p", i, f"http://w{i}:1", ENGINES["vllm"])
    w.engine_running, w.engine_waiting, w.kv_usage, w.scraped_at = 1.0, waiting, kv, scraped_at
    return w


def test_room_is_max_waiting_less_the_engines_queue() -> None:
    assert worker_room(worker(waiting=0), None, FLOW) == 2
    assert worker_room(worker(waiting=1), None, FLOW) == 1
    assert worker_room(worker(waiting=5), None, FLOW) == 0
    assert worker_room(worker(waiting=None, kv=None), None, FLOW) == 2  # no load metrics: its own requests only


def test_a_full_kv_cache_is_saturated_whatever_the_queue() -> None:
    assert worker_room(worker(waiting=0, kv=0.9), None, FLOW) == 0
    assert worker_room(worker(waiting=0, kv=0.89), None, FLOW) == 2


def test_requests_sent_since_the_scrape_count_until_they_start() -> None:
    changes: list[int] = []
    starts = Starts()
    w = worker(waiting=0, scraped_at=time.monotonic() - 1)
    before = StartTicket(starts, 100, False, lambda: changes.append(1))
    w.scraped_at = time.monotonic()                 # a scrape after `before` was sent: the engine counts it
    assert worker_room(w, starts, FLOW) == 2
    after = StartTicket(starts, 100, True, lambda: changes.append(2))
    assert worker_room(w, starts, FLOW) == 1
    after.started(0.0)                              # its first byte: running, not waiting
    after.close()                                   # idempotent
    assert worker_room(w, starts, FLOW) == 2 and changes == [2]
    before.close()
    assert starts.tickets == [] and changes == [2, 1]


def test_a_decode_worker_counts_every_not_started_request() -> None:
    """A PD pool's decode engine sees a request only after its prefill: the scrape says nothing of it."""
    starts = Starts()
    StartTicket(starts, 10, True, lambda: None)
    w = worker(waiting=0, scraped_at=time.monotonic() + 1)
    assert worker_room(w, starts, FLOW) == 2
    assert worker_room(w, starts, FLOW, decode=True) == 1


def test_the_prefill_queue_counts_streams_until_their_first_token_non_streams_until_a_scrape() -> None:
    """A stream prefilling there is running for the engine (not waiting) but a new request waits
    behind its prefill: it counts until its first token. A non-streamed one's first byte is its
    end: it counts only until a scrape sees it."""
    flow = FLOW.model_copy(update={"max_prefill_tokens": 1000, "max_waiting": 10})
    starts = Starts()
    w = worker(waiting=0, scraped_at=time.monotonic() - 1)
    stream = StartTicket(starts, 600, True, lambda: None)
    batch = StartTicket(starts, 600, False, lambda: None)
    assert worker_room(w, starts, flow) == 0          # 1,200 tokens to prefill
    w.scraped_at = time.monotonic()                    # both in the engine's counts now
    assert starts.prefill(w.scraped_at) == 600
    assert worker_room(w, starts, flow) == 1          # one at a time under the prefill bound
    StartTicket(starts, 400, True, lambda: None)
    assert worker_room(w, starts, flow) == 0
    stream.close()
    assert worker_room(w, starts, flow) == 1
    batch.close()
    assert worker_room(w, starts, flow, decode=True) == 9  # no prefill bound on a decode worker: 10 less one
    unbounded = flow.model_copy(update={"max_prefill_tokens": None})
    assert worker_room(w, starts, unbounded) == 9     # max_waiting less the one sent since the scrape


def pool_config(**extra: object) -> PoolConfig:
    return PoolConfig.model_validate({"name": "p", "engine": "vllm", "workers": ["http://w0:1", "http://w1:1"],
                                      "max_context_tokens": 1000, **extra})


def test_the_pools_room_sums_its_workers_within_the_gates_limits() -> None:
    workers = [worker(0, waiting=0), worker(1, waiting=1)]
    assert pool_room(workers, None, PoolGate(pool_config()), lambda w: None, FLOW) == 3
    gate = PoolGate(pool_config(max_in_flight_per_worker=1))
    workers[0].in_flight = 1
    assert pool_room(workers, None, gate, lambda w: None, FLOW) == 1      # w0 full by the gate, w1 has 1
    gate = PoolGate(pool_config(max_in_flight=4))
    gate.in_flight = 4
    assert pool_room(workers, None, gate, lambda w: None, FLOW) == 0


def test_a_pd_pool_has_no_room_while_every_prefill_worker_is_saturated() -> None:
    decode = [worker(0, waiting=0)]
    gate = PoolGate(pool_config())
    assert pool_room(decode, [worker(1, waiting=3)], gate, lambda w: None, FLOW) == 0
    assert pool_room(decode, [worker(1, waiting=3), worker(2, waiting=0)], gate, lambda w: None, FLOW) == 2
