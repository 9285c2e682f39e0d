"""vLLM NIXL (`mode: vllm-nixl`): the prefill leg first, then the decode leg with the KV handle
(`kv_transfer_params`) the prefill answered, once it was checked to name the prefill worker
(`gateway/protocol/pd.py`). A streaming request whose prefill leg outlasts the hold window is
committed first (keep-alives while the prefill runs), as an aggregated engine's long prefill is."""

from __future__ import annotations

import asyncio

from gateway.backends.pool_params import PoolConfig
from gateway.backends.worker import Worker
from gateway.dispatch.pd.attempt import Answer, PdAttempt
from gateway.dispatch.pd.prefill import PrefillLeg
from gateway.dispatch.pd.requests import nixl_decode_request, nixl_handle, nixl_prefill_request
from gateway.protocol.pd import foreign_kv_handle, host_of
from gateway.streaming import Holding


def side_channel(pool: PoolConfig, prefill: Worker) -> tuple[str, int | None]:
    """The (host, port or None) a KV handle of `prefill` must name: its configured
    `side_channel_host` (else its URL's host) and `side_channel_port` (None: any port)."""
    configured = pool.disaggregation.prefill if pool.disaggregation is not None else []
    entry = next((p for p in configured if p.url == prefill.url), None)
    host = (entry.side_channel_host if entry is not None else None) or host_of(prefill.url)
    return host, entry.side_channel_port if entry is not None else None


class NixlRunner:
    """The prefill leg, then the decode leg with its KV handle."""

    __slots__ = ()

    async def legs(self, pd: PdAttempt, holding: Holding, headers: dict[str, str]) -> Answer:
        """Open the prefill leg; a stream whose prefill outlasts the hold window is committed first."""
        leg = pd.start_prefill(holding, nixl_prefill_request(pd.body), headers)
        if pd.streams:
            done, _ = await asyncio.wait((leg.task,), timeout=pd.hold_window())
            if not done:
                return pd.commit_deferred(holding, lambda owned: self._decode(pd, owned, leg, headers))
        return await self._decode(pd, holding, leg, headers)

    async def _decode(self, pd: PdAttempt, holding: Holding, leg: PrefillLeg, headers: dict[str, str]) -> Answer:
        """The prefill leg's answer, its handle checked, then the decode leg with it. A handle that
        is no object, or names another host or port than the prefill worker's, fails the attempt
        against the prefill worker (protocol_error): the decode worker never sees it."""
        answer = await pd.prefill_answer(leg)
        try:
            handle = nixl_handle(answer)
        except ValueError as exc:
            raise pd.prefill_refused(str(exc), counted=False) from None
        refused = None if handle is None else foreign_kv_handle(handle, *side_channel(pd.pool, pd.prefill))
        if refused is not None:
            raise pd.prefill_refused(refused, counted=True)
        return await pd.decode(holding, headers, nixl_decode_request(pd.body, handle))


NIXL = NixlRunner()
