"""Where the PD protocol fields sit in a request a worker received, values aside.

`pd_wire_shape(record)` maps each protocol field present in a request to its JSON type, by path:
`body.bootstrap_room` -> "int", `body.kv_transfer_params.remote_block_ids` -> "list[int]",
`header.x-request-id` -> "str" ... `pd_wire_constants(record)` gives the values that ARE the
protocol (a prefill leg's `stream: false`, `max_tokens: 1`, the `do_remote_*` flags).
tests/integration/sim/test_sim_pd_peers.py records what sglang-router and vllm-router send to the
simulator and checks both against `tests/integration/sim/pd_wire_shapes.json`; a gateway test can
check its own legs against the same file, so the gateway sends the protocol fields where the peers
do (the protocols, their field lists `PD_BODY_FIELDS` and `PD_HEADERS`: `gateway/protocol/pd.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.protocol.pd import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_TRANSFER_PARAMS, PD_BODY_FIELDS, PD_HEADERS
from gateway.sim.worker_state import SimRequestRecord

CONSTANT_PATHS = ("body.stream", "body.max_tokens", "body.max_completion_tokens", "body.min_tokens",
                  f"body.{KV_TRANSFER_PARAMS}.{DO_REMOTE_DECODE}", f"body.{KV_TRANSFER_PARAMS}.{DO_REMOTE_PREFILL}")
"""Paths whose value is part of the protocol on a prefill leg (see `pd_wire_constants`)."""


def json_type(value: Any) -> str:
    """The JSON type of a value: "null", "bool", "int", "float", "str", "object", or "list[T]"
    (T the element type when all agree, "mixed" otherwise, "empty" for [])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list):
        kinds = {json_type(item) for item in value}
        return "list[empty]" if not kinds else f"list[{kinds.pop() if len(kinds) == 1 else 'mixed'}]"
    return type(value).__name__


def _flatten(record: SimRequestRecord | Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    if isinstance(record, SimRequestRecord):
        body, headers = record.body, record.headers
    else:
        body, headers = record["body"], record["headers"]
    values: dict[str, Any] = {}
    if isinstance(body, Mapping):
        for name in PD_BODY_FIELDS:
            if name in body:
                values[f"body.{name}"] = body[name]
        params = body.get(KV_TRANSFER_PARAMS)
        if isinstance(params, Mapping):
            for key, value in params.items():
                values[f"body.{KV_TRANSFER_PARAMS}.{key}"] = value
    lowered = {k.lower(): v for k, v in headers.items()}
    return values, {name: lowered[name] for name in PD_HEADERS if name in lowered}


def pd_wire_shape(record: SimRequestRecord | Mapping[str, Any]) -> dict[str, str]:
    """{path: JSON type} of the PD protocol fields in one received request (a `SimRequestRecord`
    or its `to_json()` dict); paths are `body.<field>`, `body.kv_transfer_params.<key>` and
    `header.<lowercase name>`. Fields absent from the request are absent from the shape."""
    values, headers = _flatten(record)
    shape = {path: json_type(value) for path, value in values.items()}
    shape.update({f"header.{name}": "str" for name in headers})
    return dict(sorted(shape.items()))


def pd_wire_constants(record: SimRequestRecord | Mapping[str, Any]) -> dict[str, Any]:
    """{path: value} of the `CONSTANT_PATHS` present in one received request."""
    values, _ = _flatten(record)
    return {path: values[path] for path in CONSTANT_PATHS if path in values}
