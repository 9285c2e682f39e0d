"""The request body as a JSON object, decoded once with orjson.

orjson turns an integer beyond 64 bits into a float, so a re-serialised body would carry
`1.8446744073709552e+19` where the client sent `18446744073709551616`. Request parameters that
are integers live at the top level (`seed`, `n`, `max_tokens`, ...), so a top-level float of
2^63 or more is checked against the raw text (only then, with a few `bytes.find` scans whatever
the body's size), and an integer outside the 64-bit range is a 400, as OpenAI answers an
out-of-range `seed`. Deeper numbers (inside `tools` schemas, say) are forwarded as JSON numbers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from gateway.errors import InvalidRequest

_INT64_EDGE = 2.0**63
MAX_SUSPECTS = 4  # top-level numbers >= 2^63 one request may have (no OpenAI parameter takes one)
MAX_OCCURRENCES = 64  # places a suspect's key is looked at
_VALUE = re.compile(rb"\s*:\s*(-?[0-9][0-9.eE+-]*)")
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # i64 and u64 together: what orjson keeps exact


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The request body (UTF-8 JSON bytes) as a dict. Raises InvalidRequest (400, `invalid_json`)
    for an empty body, invalid JSON or another JSON type, and (400, `integer_out_of_range`) for a
    top-level integer outside the 64-bit range."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    suspects = [name for name, value in data.items() if type(value) is float and abs(value) >= _INT64_EDGE]
    if suspects:
        _check_integers(body, suspects)
    return data


def _check_integers(body: bytes, names: list[str]) -> None:
    """400 when a suspect's number text is an integer outside the 64-bit range. Costs at most
    `MAX_SUSPECTS` x 2 spellings x `MAX_OCCURRENCES` C-speed `bytes.find` steps, whatever the body's size: a key
    can only appear unescaped as a key or a string (inside a string its quotes are escaped)."""
    if len(names) > MAX_SUSPECTS:
        raise InvalidRequest(f"More than {MAX_SUSPECTS} top-level numbers of 2^63 or more.", param=names[0],
                             code="integer_out_of_range")
    for name in names:
        float_written = False
        # As UTF-8 and as Python's json (so `requests`) writes a non-ASCII key: `"\u00bb"`.
        for key in dict.fromkeys((orjson.dumps(name), json.dumps(name).encode())):
            at, seen = body.find(key), 0
            while at >= 0 and seen < MAX_OCCURRENCES:
                seen += 1
                match = _VALUE.match(body, at + len(key))
                if match is not None:
                    text = match.group(1).decode("ascii")
                    if not text.lstrip("-").isdigit():
                        float_written = True
                    elif not _INT_MIN <= int(text) <= _INT_MAX:
                        _refuse(name, text)
                at = body.find(key, at + len(key))
        if not float_written:  # its key only written with escapes (or past the scan): take it for an integer
            _refuse(name, None)


def _refuse(name: str, text: str | None) -> None:
    if text is None:
        message = f"The value of '{name}' does not fit in 64 bits."
    else:
        message = f"The integer {text if len(text) <= 40 else text[:37] + '...'} does not fit in 64 bits."
    raise InvalidRequest(message, param=name, code="integer_out_of_range")


ENGINE_ID_FIELDS = ("request_id", "rid")
"""Body fields an engine takes as its own request id, never forwarded (the gateway assigns engine
request ids, `RequestRecord.engine_request_id`): vLLM's `request_id` (chat, completions, Responses;
on the Responses API it becomes the stored response's id, `ResponsesRequest.request_id` in
`vllm/entrypoints/openai/protocol.py`, the `response_store` key in `serving_responses.py`, so a
client could overwrite another tenant's stored response) and SGLang's `rid`."""

SCHEDULING_FIELDS = ("priority", "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank")
"""Body fields that steer an engine's scheduler: vLLM's and SGLang's `priority` (the waiting queue's
order under priority scheduling: vLLM `vllm/entrypoints/openai/chat_completion/protocol.py`,
`completion/protocol.py`, `responses/protocol.py`; SGLang `python/sglang/srt/entrypoints/openai/protocol.py`)
and SGLang's data-parallel rank fields there (`routed_dp_rank`, `disagg_prefill_dp_rank`, the deprecated
`data_parallel_rank`: which DP rank serves the request). The gateway's to set: stripped from a
client's body unless its key may set them (gateway/flow/priority.py)."""

KV_TRANSFER_FIELDS = ("kv_transfer_params", "ec_transfer_params", "bootstrap_host", "bootstrap_port",
                      "bootstrap_room")
"""Body fields that steer a worker's KV connector: vLLM's `kv_transfer_params` (the NIXL or Mooncake
handle a decode worker pulls KV from: `remote_host`, `remote_port`, `remote_bootstrap_addr`), its
`ec_transfer_params` (the encoder-cache connector's handle: a consumer pulls the encodings from the
`peer_host`/`peer_port` it names) and SGLang's bootstrap fields (the prefill worker a decode worker
connects to). Stripped from every client body unless the pool sets `allow_kv_transfer_fields`; a PD
pool writes its own on both legs. vLLM's chat, completions and Responses requests
(`vllm/entrypoints/openai/*/protocol.py`, `to_sampling_params`) take the client's `vllm_xargs` dict
as `SamplingParams.extra_args` and only then add their own `kv_transfer_params` /
`ec_transfer_params`, which the connectors read from there: so those keys inside `vllm_xargs`
(`XARGS_FIELD`) are stripped with them (`without_connector_args`)."""

XARGS_FIELD = "vllm_xargs"
"""vLLM's body field of extra sampling arguments (`SamplingParams.extra_args`)."""


def without_connector_args(xargs: Any) -> Any:
    """A client's `vllm_xargs` without the `KV_TRANSFER_FIELDS` keys (the same object when it has
    none, or is not a dict: the engine judges that)."""
    if not isinstance(xargs, dict) or not any(name in xargs for name in KV_TRANSFER_FIELDS):
        return xargs
    return {name: value for name, value in xargs.items() if name not in KV_TRANSFER_FIELDS}
