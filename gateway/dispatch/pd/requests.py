"""The pure request builders of the PD protocols: the engine body (parsed once, a dict that is
never changed) and the facts of the workers -> the bytes of each leg's request, each encoded once.
The field shapes are `gateway/protocol/pd.py`'s."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocol.pd import (
    KV_TRANSFER_PARAMS,
    NIXL_PREFILL_PARAMS,
    bootstrap_fields,
    mooncake_decode_params,
    mooncake_prefill_params,
    vllm_prefill_body,
)


def sglang_request(body: dict[str, Any], host: str, port: int | None, rooms: list[int]) -> bytes:
    """SGLang's one request for both legs: `body` plus `bootstrap_host` (`host`), `bootstrap_port`
    (`port`) and `bootstrap_room` (`rooms`, one per prompt: `protocol.pd.fresh_rooms`). Raises
    ValueError when `rooms` does not fit the prompts."""
    return orjson.dumps({**body, **bootstrap_fields(body, host, port, rooms)})


def nixl_prefill_request(body: dict[str, Any]) -> bytes:
    """vLLM NIXL's prefill leg: `body` generating one token, not streamed, asking to keep its KV
    for a remote decode (`NIXL_PREFILL_PARAMS`)."""
    return orjson.dumps(vllm_prefill_body(body, dict(NIXL_PREFILL_PARAMS)))


def nixl_decode_request(body: dict[str, Any], handle: dict[str, Any] | None) -> bytes:
    """vLLM NIXL's decode leg: `body` plus the prefill answer's `kv_transfer_params` (`handle`;
    None is sent as null: the decode worker prefills locally)."""
    return orjson.dumps({**body, KV_TRANSFER_PARAMS: handle})


def nixl_handle(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a NIXL prefill leg's JSON answer (None when absent or null).
    Raises ValueError (its message the reason) for an answer that is not a JSON object, or whose
    `kv_transfer_params` is not an object: a decode worker would refuse it with a 400 the client
    would be blamed for."""
    try:
        handle = orjson.loads(answer).get(KV_TRANSFER_PARAMS)
    except (orjson.JSONDecodeError, AttributeError):
        raise ValueError("the prefill answer is not a JSON object") from None
    if handle is not None and not isinstance(handle, dict):
        raise ValueError("the prefill answer's kv_transfer_params is not an object")
    return handle


def mooncake_requests(body: dict[str, Any], transfer_id: str, bootstrap: str, engine_id: str) -> tuple[bytes, bytes]:
    """vLLM Mooncake's two legs, (prefill, decode), tied by `transfer_id`: the prefill leg shaped
    as NIXL's keeping its KV under the transfer id; the decode leg `body` naming the prefill's
    bootstrap server (`bootstrap`, http://host:port) and engine id (`engine_id`)."""
    prefill = vllm_prefill_body(body, mooncake_prefill_params(transfer_id))
    decode = {**body, KV_TRANSFER_PARAMS: mooncake_decode_params(transfer_id, bootstrap, engine_id)}
    return orjson.dumps(prefill), orjson.dumps(decode)
