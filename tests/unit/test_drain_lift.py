"""A drain holds for the engine it was placed on (gateway/backends/drains.py `DrainBoard.engine_seen`):
lifted once the prober saw the engine answer, go away and a new one answer; never otherwise."""

from __future__ import annotations

import pytest

from gateway.backends.drains import DrainBoard
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config


def board() -> DrainBoard:
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 1000,
                                      "workers": ["http://127.0.0.1:9"]}]}, environ={})
    return DrainBoard(WorkerRegistry(config), None, "kgw-unit")


@pytest.mark.anyio
async def test_a_drain_lifts_when_a_new_engine_answers_where_the_drained_one_was() -> None:
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    for up in (True, True, False, False):  # answered while drained, then went away
        await drains.engine_seen(worker, up=up)
        assert worker.draining
    await drains.engine_seen(worker, up=True)  # a new engine
    assert not worker.draining


@pytest.mark.anyio
async def test_a_drain_on_an_engine_already_gone_holds_when_it_comes_back() -> None:
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    for up in (False, True, True):  # an operator kept a broken engine out: it answering is not enough
        await drains.engine_seen(worker, up=up)
    assert worker.draining
    await drains.engine_seen(worker, up=False)
    await drains.engine_seen(worker, up=True)  # it answered, went away, and another answers now
    assert not worker.draining


@pytest.mark.anyio
async def test_an_undrain_forgets_what_was_seen() -> None:
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    await drains.engine_seen(worker, up=True)
    await drains.engine_seen(worker, up=False)
    await drains.set_draining(worker, False)
    await drains.set_draining(worker, True)  # drained again: the earlier absence does not count
    await drains.engine_seen(worker, up=True)
    assert worker.draining
