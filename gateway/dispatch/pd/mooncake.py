"""vLLM Mooncake (`mode: vllm-mooncake`): both legs at once, tied by a fresh `transfer_id`; the
decode leg names the prefill worker's bootstrap server and its engine id, read from the bootstrap
server's `GET /query` once and kept by the registry, forgotten when an attempt through the worker
fails (a restarted engine has a new id; `gateway/protocol/pd.py`)."""

from __future__ import annotations

import httpx

from gateway.dispatch.pd.attempt import Answer, PdAttempt
from gateway.dispatch.pd.requests import mooncake_requests
from gateway.protocol.pd import MOONCAKE_QUERY_PATH, bootstrap_addr, host_of, new_transfer_id, rank0_engine_id
from gateway.streaming import AttemptFailed, Holding, Outcome


async def mooncake_engine_id(http: httpx.AsyncClient, bootstrap: str) -> str:
    """The engine id a vLLM Mooncake prefill worker's bootstrap server (`bootstrap`:
    http://host:port) reports for DP rank 0 (`GET /query`, `protocol.pd.rank0_engine_id`). Raises
    AttemptFailed: connect_error when it cannot be read, protocol_error when it names none."""
    try:
        response = await http.get(bootstrap + MOONCAKE_QUERY_PATH)
        response.raise_for_status()
        engine_id = rank0_engine_id(response.json())
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise AttemptFailed(Outcome.CONNECT_ERROR, f"prefill bootstrap server {bootstrap}{MOONCAKE_QUERY_PATH}: "
                            f"{type(exc).__name__}") from exc
    if not isinstance(engine_id, str):
        raise AttemptFailed(Outcome.PROTOCOL_ERROR, f"prefill bootstrap server {bootstrap}{MOONCAKE_QUERY_PATH}: "
                            "no engine_id")
    return engine_id


class MooncakeRunner:
    """Both legs at once, tied by a transfer id, naming the prefill's bootstrap server and engine id."""

    __slots__ = ()

    async def legs(self, pd: PdAttempt, holding: Holding, headers: dict[str, str]) -> Answer:
        """The engine id (learned when unknown), both requests (`mooncake_requests`), both legs at once."""
        prefill, registry = pd.prefill, pd.state.registry
        bootstrap = bootstrap_addr(host_of(prefill.url), prefill.bootstrap_port)
        engine_id = prefill.pd_engine_id
        if engine_id is None:
            try:
                engine_id = await mooncake_engine_id(pd.state.http, bootstrap)
            except AttemptFailed:
                pd.blame_prefill()
                raise
            registry.engine_id_learned(prefill, engine_id)
        prefill_body, decode_body = mooncake_requests(pd.body, new_transfer_id(), bootstrap, engine_id)
        leg = pd.start_prefill(holding, prefill_body, headers)
        try:
            return await pd.both(holding, leg, headers, decode_body)
        except AttemptFailed:
            # A decode leg fails too when it named a restarted prefill engine's old id (its prefill
            # legs still succeed): read the id again for the next attempt.
            registry.engine_id_stale(prefill)
            raise


MOONCAKE = MooncakeRunner()
