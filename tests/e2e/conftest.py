"""Real llama.cpp workers shared across the e2e files that only need a plain 2K-context engine (each
start costs seconds of CPU on a 2-core machine; under xdist, once per worker process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.cpu_engine import LlamaCppSettings, LlamaCppWorker


@pytest.fixture(scope="session")
def worker_2k() -> Iterator[LlamaCppWorker]:
    """SmolLM2-135M served by llama.cpp with a 2,048-token context on 2 threads."""
    engine = LlamaCppWorker(LlamaCppSettings(n_ctx=2048, threads=2)).start()
    try:
        yield engine
    finally:
        engine.stop()
