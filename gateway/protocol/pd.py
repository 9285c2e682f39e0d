"""The prefill/decode (PD) wire protocols between a router and its engines: the field names, their
shapes and values, the endpoints, and the pure functions that write and read them.

A PD pair is two workers: a prefill worker computes the prompt's KV cache, a decode worker
receives it and generates the answer the client gets. The gateway speaks three protocols
(`gateway/dispatch/pd/` runs them); its simulated engines (`gateway/sim/pd.py`, `pd_leg.py`,
`pd_wire.py`) read them from here. tests/integration/sim/test_sim_pd_peers.py records what
sglang-router 0.3.2 and vllm-router 0.1.17 send to the simulator and
tests/integration/test_pd_wire.py checks the gateway's legs against the same recorded shapes
(`tests/integration/sim/pd_wire_shapes.json`).

Sources (read, not copied): SGLang's router `sgl-router/src/routers/http/pd_router.rs`
(`inject_bootstrap_into_value`) and `pd_types.rs` (`generate_room_id`) in sgl-project/sglang, its
engine's `python/sglang/srt/entrypoints/openai/protocol.py` (the request's bootstrap fields) and
`python/sglang/srt/disaggregation/` (`decode.py`, `prefill.py`); vLLM's router
`src/routers/http/vllm_pd_router.rs` in vllm-project/router; vLLM's connectors
`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py` and
`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py` (bootstrap server in
`mooncake_utils.py`) in vllm-project/vllm.

SGLang bootstrap (`mode: sglang`; prefill `--disaggregation-mode prefill
--disaggregation-bootstrap-port P`, decode `--disaggregation-mode decode`):

- The SAME body goes to a prefill and a decode worker at once, plus three top-level fields:
  `bootstrap_host` (the prefill worker's host, a string), `bootstrap_port` (its bootstrap server's
  port, an int; null when none is known) and `bootstrap_room` (a random int in 0..2^63-1,
  `MAX_ROOM`, fresh per request). For a batch of prompts (a `/v1/completions` prompt that is a list
  of strings or of token lists) all three are lists, one entry per prompt (`batch_size`).
- The decode worker connects to `bootstrap_host:bootstrap_port`, registers for the room and waits
  for the KV; the prefill worker computes once its decode partner has bootstrapped, sends the KV
  and answers. The router relays the decode worker's answer and reads the prefill's to its end.

vLLM NixlConnector (`mode: vllm-nixl`; `--kv-transfer-config '{"kv_connector":"NixlConnector",...}'`):

- Both legs carry the same `X-Request-Id` (`REQUEST_ID_HEADER`).
- The prefill leg first: the request with `stream: false`, `max_tokens: 1`,
  `max_completion_tokens: 1` when present, no `stream_options` (and no `min_tokens`: the gateway
  drops it, `PREFILL_DROPPED_FIELDS`; vllm-router 0.1.17 sets it to 1), and `kv_transfer_params`
  asking for a remote decode (`NIXL_PREFILL_PARAMS`).
- The prefill answer (JSON) carries a top-level `kv_transfer_params`, the KV handle:
  `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [int...],
  "remote_engine_id": str, "remote_request_id": str, "remote_host": str, "remote_port": int,
  "tp_size": int}` (`NixlConnectorScheduler.request_finished`). `remote_host:remote_port` is the
  prefill worker's NIXL side channel (`VLLM_NIXL_SIDE_CHANNEL_PORT`, `NIXL_SIDE_CHANNEL_PORT` by
  default), where the decode worker reads the blocks (`foreign_kv_handle` checks it names the
  prefill worker that answered).
- Then the decode leg: the ORIGINAL request plus that `kv_transfer_params` object (null when the
  answer had none: the decode worker then prefills locally).

vLLM MooncakeConnector (`mode: vllm-mooncake`; `vllm-router --kv-connector mooncake`):

- The prefill worker's bootstrap server (`VLLM_MOONCAKE_BOOTSTRAP_PORT`,
  `MOONCAKE_BOOTSTRAP_PORT` by default) answers `GET /query` (`MOONCAKE_QUERY_PATH`) with each DP
  rank's `{"engine_id": str, "worker_addr": {tp_rank: {pp_rank: "host:port"}}}` (JSON keys are
  strings; `rank0_engine_id`).
- Per request a fresh `transfer_id` ("xfer-" + a UUID, `new_transfer_id`) ties BOTH legs, sent at
  once with one `X-Request-Id`: the prefill leg shaped as NIXL's but with
  `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}`;
  the decode leg the original request plus `{"do_remote_decode": false, "do_remote_prefill": true,
  "transfer_id": T, "remote_bootstrap_addr": "http://{host}:{bootstrap port}",
  "remote_engine_id": E}` (`mooncake_prefill_params`, `mooncake_decode_params`).
- The prefill answers with no `kv_transfer_params`; the decode worker finds the prefill worker
  through its bootstrap server and the prefill pushes the blocks the decode lacks.

The gateway's own leg requests also carry its engine request id as `x-request-id` on both legs
(never the client's: `gateway/dispatch/attempt.py`, `upstream_headers`), and a client's own
`kv_transfer_params` / `bootstrap_*` fields never reach a leg (`gateway/parsing.py` strips them;
each protocol writes its own).
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any
from urllib.parse import urlsplit

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
BOOTSTRAP_FIELDS = (BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM)
"""SGLang's three top-level fields, on both legs."""

MAX_ROOM = (1 << 63) - 1
"""The largest SGLang bootstrap room: rooms are non-negative 63-bit ints (`pd_types.rs`)."""

KV_TRANSFER_PARAMS = "kv_transfer_params"
"""vLLM's top-level KV connector field: in a leg's request and in a NIXL prefill's answer."""

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_BOOTSTRAP_ADDR = "remote_bootstrap_addr"
TRANSFER_ID = "transfer_id"

NIXL_PREFILL_PARAMS: dict[str, Any] = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, REMOTE_ENGINE_ID: None,
                                       REMOTE_BLOCK_IDS: None, REMOTE_HOST: None, REMOTE_PORT: None}
"""The `kv_transfer_params` of a NIXL prefill leg (`vllm_pd_router.rs`): keep the KV for a remote
decode. Copy it before putting it into a body."""

PREFILL_DROPPED_FIELDS = ("stream_options", "min_tokens")
"""Top-level fields a vLLM prefill leg goes without (it is not streamed and generates one token)."""

REQUEST_ID_HEADER = "x-request-id"
"""The header both legs of one request share (vLLM ties the legs by it)."""

PD_BODY_FIELDS = (*BOOTSTRAP_FIELDS, KV_TRANSFER_PARAMS, "stream", "stream_options", "max_tokens",
                  "max_completion_tokens", "min_tokens")
"""Top-level body fields a PD router sets, removes or rewrites."""

PD_HEADERS = (REQUEST_ID_HEADER,)
"""Headers that tie the two legs of a PD request together."""

MOONCAKE_QUERY_PATH = "/query"
"""The Mooncake bootstrap server's engine table (`GET`)."""

MOONCAKE_BOOTSTRAP_PORT = 8998
"""`VLLM_MOONCAKE_BOOTSTRAP_PORT`'s default (SGLang's `--disaggregation-bootstrap-port` too)."""

NIXL_SIDE_CHANNEL_PORT = 5600
"""`VLLM_NIXL_SIDE_CHANNEL_PORT`'s default."""

TRANSFER_ID_PREFIX = "xfer-"


def fresh_room() -> int:
    """A random SGLang bootstrap room, 0..`MAX_ROOM` (never reused: each attempt draws its own)."""
    return secrets.randbelow(MAX_ROOM + 1)


def batch_size(body: dict[str, Any]) -> int | None:
    """How many prompts a completions body carries when it is a batch (a list of strings or of
    token lists), else None (one prompt: chat, a string, one token list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return None


def bootstrap_fields(body: dict[str, Any], host: str, port: int | None, rooms: list[int]) -> dict[str, Any]:
    """SGLang's three bootstrap fields for `body` with the given rooms (one per prompt: a batch's
    fields are lists, else `rooms[0]` and scalars). Raises ValueError when `rooms` does not have
    one room per prompt."""
    n = batch_size(body)
    if len(rooms) != (n or 1):
        raise ValueError(f"{len(rooms)} bootstrap rooms for {n or 1} prompts")
    if n is None:
        return {BOOTSTRAP_HOST: host, BOOTSTRAP_PORT: port, BOOTSTRAP_ROOM: rooms[0]}
    return {BOOTSTRAP_HOST: [host] * n, BOOTSTRAP_PORT: [port] * n, BOOTSTRAP_ROOM: list(rooms)}


def fresh_rooms(body: dict[str, Any]) -> list[int]:
    """One fresh room per prompt of `body` (`batch_size`, else one)."""
    return [fresh_room() for _ in range(batch_size(body) or 1)]


def sglang_fields(body: dict[str, Any], host: str, port: int | None) -> dict[str, Any]:
    """SGLang's three bootstrap fields for `body` with fresh rooms: lists (one entry per prompt) for a batch."""
    return bootstrap_fields(body, host, port, fresh_rooms(body))


def vllm_prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of vLLM's PD protocols: `body` (not changed) generating one token, not
    streamed, with `kv_transfer_params`."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


def new_transfer_id() -> str:
    """A fresh Mooncake `transfer_id`: "xfer-" + a UUID."""
    return f"{TRANSFER_ID_PREFIX}{uuid.uuid4()}"


def mooncake_prefill_params(transfer_id: str) -> dict[str, Any]:
    """A Mooncake prefill leg's `kv_transfer_params`: keep the KV under `transfer_id`."""
    return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, TRANSFER_ID: transfer_id}


def mooncake_decode_params(transfer_id: str, bootstrap: str, engine_id: str) -> dict[str, Any]:
    """A Mooncake decode leg's `kv_transfer_params`: take the KV of `transfer_id` from the prefill
    engine `engine_id` behind the bootstrap server `bootstrap` (http://host:port)."""
    return {DO_REMOTE_DECODE: False, DO_REMOTE_PREFILL: True, TRANSFER_ID: transfer_id,
            REMOTE_BOOTSTRAP_ADDR: bootstrap, REMOTE_ENGINE_ID: engine_id}


def host_of(url: str) -> str:
    """The host part of a worker URL (no brackets for IPv6)."""
    return urlsplit(url).hostname or ""


def bootstrap_addr(host: str, port: int | None) -> str:
    """The URL of a prefill worker's bootstrap server: http://host:port (an IPv6 host bracketed)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def rank0_engine_id(table: Any) -> Any:
    """The `engine_id` a Mooncake bootstrap server's `GET /query` answer (`table`, decoded JSON)
    names for its lowest DP rank (numeric keys in order, others after). Raises KeyError,
    IndexError or TypeError for a table without one; the value is returned as it is (the caller
    checks it is a string)."""
    ranks = sorted(table, key=lambda k: int(k) if str(k).isdigit() else 1 << 30)
    return table[ranks[0]]["engine_id"]


def foreign_kv_handle(params: dict[str, Any], expected_host: str, expected_port: int | None) -> str | None:
    """Why a NIXL prefill answer's `kv_transfer_params` must not reach a decode worker, or None.

    The decode worker reads the KV blocks from the handle's `remote_host:remote_port` (the NIXL
    side channel), so a handle is only passed on when it names the prefill worker that answered:
    `remote_host` `expected_host` (compared case-insensitively, brackets aside) and `remote_port`
    a port, `expected_port` when given. A handle without a remote prefill (`do_remote_prefill` not
    true and no host or port: the decode worker then prefills locally) passes."""
    host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
    if params.get(DO_REMOTE_PREFILL) is not True and host is None and port is None:
        return None
    if not isinstance(host, str) or host.strip("[]").lower() != expected_host.strip("[]").lower():
        return (f"the prefill answer's KV handle names remote_host {str(host)[:80]!r}, not the prefill worker's "
                f"{expected_host!r}")
    if type(port) is not int or not 0 < port < 65536 or (expected_port is not None and port != expected_port):
        return (f"the prefill answer's KV handle names remote_port {str(port)[:20]!r}"
                + (f", not the prefill worker's {expected_port}" if expected_port is not None else ""))
    return None
