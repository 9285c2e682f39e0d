"""Real llama.cpp workers shared across the e2e files that only need a plain 2K-context engine (each
start costs seconds of CPU on a 2-core machine; under xdist, once per worker process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.llamacpp_worker import LlamaCppSettings, LlamaCppWorker


@pytest.fixture(scope="session")
def worker_2k() -> Iterator[LlamaCppWorker]:
    """SmolLM2-135M served by llama.cpp with a 2,048-token context on 1 thread (the default).

    Not 2 threads: ggml's threads meet at a barrier after every operation, and on 2 cores busy with
    the other xdist worker, the gateway and the tests each barrier waits for a time slice. Measured
    under load: the Messages file took 34.8 s with 2 threads, 5.2 s with 1 (a cold 724-token prompt
    21.7 s against 7.2 s, a cached one 4.3 s against 0.15 s); gateway/llamacpp_worker/README.md has the
    quiet-machine table."""
    engine = LlamaCppWorker(LlamaCppSettings(n_ctx=2048)).start()
    try:
        yield engine
    finally:
        engine.stop()
