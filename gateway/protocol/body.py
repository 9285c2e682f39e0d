"""The request body as a JSON object, decoded once with orjson.

orjson turns an integer beyond 64 bits into a float, so a re-serialised body would carry
`1.8446744073709552e+19` where the client sent `18446744073709551616`. Request parameters that
are integers live at the top level (`seed`, `n`, `max_tokens`, ...), so a top-level float of
2^63 or more is checked against the raw text (only then), and an integer outside the 64-bit range
is a 400, as OpenAI answers an out-of-range `seed`. Deeper numbers (inside `tools` schemas, say)
are forwarded as JSON numbers.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import InvalidRequest

_INT64_EDGE = 2.0**63
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
    # Find each suspect's number text in the raw body: a C-speed search, where re-parsing a 64 MiB
    # body with the stdlib would stall the event loop. An escaped quote (inside a string) is skipped.
    for name in names:
        key = re.escape(orjson.dumps(name))
        for match in re.finditer(rb'(?<!\\)' + key + rb"\s*:\s*(-?[0-9][0-9.eE+-]*)", body):
            text = match.group(1).decode("ascii")
            if text.lstrip("-").isdigit() and not _INT_MIN <= int(text) <= _INT_MAX:
                shown = text if len(text) <= 40 else text[:37] + "..."
                raise InvalidRequest(f"The integer {shown} does not fit in 64 bits.", param=name,
                                     code="integer_out_of_range")
