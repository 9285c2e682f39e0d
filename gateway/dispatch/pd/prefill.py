"""The prefill leg of a PD attempt: its own task, sending the leg's request and reading the whole
answer within the prefill budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.backends.client import TransportError, UpstreamTimeouts
from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dispatch.params import TimeoutConfig
from gateway.dispatch.pd.account import PdAccount
from gateway.state import AppState
from gateway.streaming import AttemptFailed, Outcome, first_chunk, open_upstream, read_rest


def prefill_budget(timeouts: TimeoutConfig, prompt_tokens: int) -> float:
    """Seconds a prefill worker may take to answer its leg: `timeouts.prefill_first_byte` (else
    `first_byte_base`) plus `first_byte_per_1k_tokens` per 1,000 prompt tokens. A prefill is
    prompt work only, so a non-streamed request's answer budget (its generation) is no measure of
    it: a prefill worker that accepts the leg and never answers is found within this, not minutes."""
    base = timeouts.first_byte_base if timeouts.prefill_first_byte is None else timeouts.prefill_first_byte
    return base + timeouts.first_byte_per_1k_tokens * prompt_tokens / 1000.0


class PrefillLeg:
    """The prefill leg of one PD attempt, running as its own task from creation: sends `body`,
    reads the whole answer (`answer`, bytes) and ends; `failure` is its AttemptFailed. A failed
    health probe of the prefill worker meanwhile ends it at once (`Outcome.MOVED`). Closable
    (`aclose` cancels it when still running, which closes its upstream response): owned by the
    attempt's Holding. `on_late_failure` (set once the decode stream was committed) is awaited
    when the leg fails after that. What it causes is reported to `account`: its headers
    (`prefill_answered`), its whole answer (`prefill_succeeded`), a failure after the commit
    (`prefill_failed_late`)."""

    __slots__ = ("_account", "_registry", "_task", "answer", "done_at", "failure", "on_late_failure", "started",
                 "worker")

    def __init__(self, state: AppState, pool: PoolConfig, worker: Worker, url: str, body: bytes,
                 headers: dict[str, str], timeout: UpstreamTimeouts, budget: float, account: PdAccount) -> None:
        self.worker = worker
        self._account = account
        self._registry = state.registry
        self.answer: bytes | None = None
        self.failure: AttemptFailed | None = None
        self.on_late_failure: Callable[[], Awaitable[None]] | None = None
        self.started = time.perf_counter()
        self.done_at: float | None = None
        self._task = asyncio.ensure_future(self._run(state, pool, url, body, headers, timeout, budget))

    @property
    def task(self) -> asyncio.Future[None]:
        """The leg's task (done once the leg ended, however)."""
        return self._task

    def _moved(self) -> None:
        if not self._task.done():
            self.failure = AttemptFailed(Outcome.MOVED, "the prefill worker failed a health probe")
            self._task.cancel()

    async def _run(self, state: AppState, pool: PoolConfig, url: str, body: bytes, headers: dict[str, str],
                   timeout: UpstreamTimeouts, budget: float) -> None:
        self._registry.awaiting_headers(self.worker, self._moved)
        try:
            async with asyncio.timeout(budget):
                response = await open_upstream(state.upstream, url, body, headers, timeout, pool.name)
                self._account.prefill_answered(self.worker)
                try:
                    first, rest = await first_chunk(response)
                    self.answer = await read_rest(response, first, rest, state.config.max_body_bytes)
                except (*TransportError, ValueError) as exc:
                    raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"prefill answer broke: {exc}", answered=True) from exc
                finally:
                    await response.aclose()
            self.done_at = time.perf_counter()
            self._account.prefill_succeeded(self.worker)
        except asyncio.CancelledError:
            if self.failure is None:  # cancelled by its owner: nothing to report
                raise
        except TimeoutError:  # not `answered`: another prefill worker may repeat a prefill (no generation lost)
            self.failure = AttemptFailed(Outcome.TIMEOUT, f"the prefill worker did not answer within {budget:.1f}s")
        except AttemptFailed as failure:
            self.failure = failure
        finally:
            self._registry.headers_done(self.worker, self._moved)
        if self.failure is not None and self.on_late_failure is not None:
            self._account.prefill_failed_late(self.worker, self.failure)
            await self.on_late_failure()

    async def result(self) -> bytes:
        """The prefill answer once the leg ended; raises its AttemptFailed."""
        await asyncio.wait((self._task,))
        if self.failure is not None:
            raise self.failure
        assert self.answer is not None
        return self.answer

    async def aclose(self) -> None:
        """Abort the leg when still running (its upstream response is closed); idempotent."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait((self._task,))
