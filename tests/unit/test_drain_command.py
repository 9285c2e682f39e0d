"""Finding the worker `kimi-gateway drain --worker` names in a `GET /admin/workers` answer, and the
replica URLs `--every-address` polls (gateway/drain_command.py). Names resolve through /etc/hosts
(localhost) only."""

from __future__ import annotations

import pytest

from gateway.drain_command import DrainError, every_address, find_worker

POOLS = [{"name": "p", "workers": [{"index": 0, "url": "http://localhost:8000"},
                                   {"index": 1, "url": "http://10.1.2.3:8000/"}],
          "retiring": [{"index": 2, "url": "http://10.1.2.9:8000"}]}]


def test_a_worker_is_found_by_index_or_url() -> None:
    assert find_worker(POOLS, "p", "1")["index"] == 1
    assert find_worker(POOLS, "p", "HTTP://10.1.2.3:8000")["index"] == 1  # case, trailing "/"
    with pytest.raises(DrainError, match=r"pool p has no worker http://10\.1\.2\.3:9000 \(its workers: 0: http://lo"):
        find_worker(POOLS, "p", "http://10.1.2.3:9000")
    with pytest.raises(DrainError, match=r"no pool 'q' \(pools: p\)"):
        find_worker(POOLS, "q", "0")


def test_by_its_address_when_the_gateway_knows_it_by_name() -> None:
    with pytest.raises(DrainError):
        find_worker(POOLS, "p", "http://127.0.0.1:8000")  # no name lookup unless asked
    assert find_worker(POOLS, "p", "http://127.0.0.1:8000", resolve=True)["index"] == 0
    with pytest.raises(DrainError):
        find_worker(POOLS, "p", "http://127.0.0.1:8001", resolve=True)  # the port must agree


def test_retiring_workers_count_when_asked() -> None:
    with pytest.raises(DrainError):
        find_worker(POOLS, "p", "http://10.1.2.9:8000")
    assert find_worker(POOLS, "p", "http://10.1.2.9:8000", retiring=True)["index"] == 2


def test_every_address_of_a_name() -> None:
    assert "http://127.0.0.1:8000/x" in every_address("http://localhost:8000/x")
    assert every_address("http://10.0.0.1:8000") == ["http://10.0.0.1:8000"]
    with pytest.raises(DrainError, match="does not resolve"):
        every_address("http://kimi-gateway.invalid:8000")
