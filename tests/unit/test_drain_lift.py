"""A drain holds for the engine it was placed on (gateway/backends/drains.py `DrainBoard.engine_seen`):
lifted once the prober saw the engine answer, go away and a new one answer (one with another process
start time, when the engine tells it); never otherwise. What counts as gone:
gateway/backends/control.py `engine_gone`."""

from __future__ import annotations

import errno
import socket

import pytest

from gateway.backends.control import engine_gone
from gateway.backends.drains import DrainBoard
from gateway.backends.h1 import H1ConnectError
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
async def test_one_probe_finding_the_engine_gone_is_not_enough() -> None:
    """A blip (one refused connection, one vanished name) between answers is the same engine."""
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    for up in (True, False, True, False, True, True):
        await drains.engine_seen(worker, up=up)
    assert worker.draining


@pytest.mark.anyio
async def test_a_drain_on_an_engine_already_gone_holds_when_it_comes_back() -> None:
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    for up in (False, False, True, True):  # an operator kept a broken engine out: it answering is not enough
        await drains.engine_seen(worker, up=up)
    assert worker.draining
    for up in (False, False, True):  # it answered, went away, and another answers now
        await drains.engine_seen(worker, up=up)
    assert not worker.draining


@pytest.mark.anyio
async def test_an_undrain_forgets_what_was_seen() -> None:
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    await drains.engine_seen(worker, up=True)
    await drains.engine_seen(worker, up=False)
    await drains.engine_seen(worker, up=False)
    await drains.set_draining(worker, False)
    await drains.set_draining(worker, True)  # drained again: the earlier absence does not count
    await drains.engine_seen(worker, up=True)
    assert worker.draining


@pytest.mark.anyio
async def test_the_same_process_answering_after_an_absence_keeps_its_drain() -> None:
    """An engine that tells its process start time: an absence (refused connections) followed by an
    answer with the same start time is a listener blip of the same engine; another start time is a
    new engine."""
    drains = board()
    (worker,) = drains.registry
    await drains.set_draining(worker, True)
    for up in (True, False, False):
        await drains.engine_seen(worker, up=up, started=1000.0 if up else None)
    await drains.engine_seen(worker, up=True, started=1000.0)  # the same process
    assert worker.draining
    for up in (False, False):  # a second absence must be as long as the first: counted afresh
        await drains.engine_seen(worker, up=up)
    await drains.engine_seen(worker, up=True, started=1000.0)
    assert worker.draining
    await drains.engine_seen(worker, up=False)
    await drains.engine_seen(worker, up=False)
    await drains.engine_seen(worker, up=True, started=2000.0)  # restarted
    assert not worker.draining


@pytest.mark.anyio
async def test_without_a_start_time_on_either_side_the_absence_decides() -> None:
    """An engine that tells no start time (SGLang, vLLM with several API servers), or that told one
    only before or only after: an answer, an absence, an answer is a new engine, as before."""
    for before, after in ((None, None), (1000.0, None), (None, 1000.0)):
        drains = board()
        (worker,) = drains.registry
        await drains.set_draining(worker, True)
        await drains.engine_seen(worker, up=True, started=before)
        await drains.engine_seen(worker, up=False)
        await drains.engine_seen(worker, up=False)
        await drains.engine_seen(worker, up=True, started=after)
        assert not worker.draining, (before, after)


def _raised(cause: BaseException) -> BaseException:
    """An H1ConnectError raised from `cause`, as the HTTP client raises it."""
    try:
        try:
            raise cause
        except OSError as exc:
            raise H1ConnectError(f"cannot connect: {exc}") from exc
    except H1ConnectError as outer:
        return outer


def test_a_resolver_that_fails_to_answer_is_not_an_engine_gone() -> None:
    """Only a name that does not exist counts (a deleted pod's record), not a resolver's hiccup."""
    assert engine_gone(_raised(socket.gaierror(socket.EAI_NONAME, "Name or service not known")))
    assert not engine_gone(_raised(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")))
    assert engine_gone(_raised(ConnectionRefusedError(111, "Connection refused")))
    assert not engine_gone(_raised(TimeoutError("timed out")))


def test_an_unreachable_host_or_network_is_not_an_engine_gone() -> None:
    """A network blip (no route to the host for a while) looks the same while the engine process
    lives on: it must not lift a drain."""
    for code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        assert not engine_gone(_raised(OSError(code, "No route to host")))
