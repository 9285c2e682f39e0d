"""vLLM's checks of a request's sampling parameters, as the simulator's vLLM family answers them.

vLLM builds a `SamplingParams` from every generation request (chat, completions, Messages through its
chat request, Responses) once the prompt is rendered and fits the context, and `_verify_args`
(`vllm/sampling_params.py`) refuses values out of range with a `VLLMValidationError`. The API server
answers it 400 `BadRequestError` with `param` the parameter the error names (null where it names
none) and the message `str(exc)`, which appends ` (parameter=P, value=V)` when set
(`vllm/exceptions.py`, `vllm/entrypoints/serve/exception_handling/error_response.py`). The legacy
dialect (vLLM <= 0.9) raised a plain ValueError: the same words, no suffix, `param` null.

Checked here, in vLLM's order, the common ones: `presence_penalty` and `frequency_penalty` in
[-2, 2], `repetition_penalty` finite and > 0, `temperature` finite, >= 0 and <= 2, `top_p` in (0, 1],
`top_k` >= -1, `min_p` in [0, 1]. An absent or null field takes vLLM's default (which passes); a
value that is no number is left alone (the request models' own validation, not imitated here).
Values are printed as the request models hold them: the float fields as Python floats (-1 is
"-1.0"), `top_k` as an int.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gateway.sim.dialects import EngineDialect, ErrorReply
from gateway.sim.request_ids import VLLM_FAMILY

_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")

_Check = tuple[str, Callable[[float], bool], Callable[[float], str], bool]
"""(field, refuses the value, the message, the error names the field as its parameter)."""

_CHECKS: tuple[_Check, ...] = (
    ("presence_penalty", lambda v: not -2.0 <= v <= 2.0, lambda v: f"presence_penalty must be in [-2, 2], got {v}.",
     False),
    ("frequency_penalty", lambda v: not -2.0 <= v <= 2.0,
     lambda v: f"frequency_penalty must be in [-2, 2], got {v}.", False),
    ("repetition_penalty", lambda v: not math.isfinite(v),
     lambda v: f"repetition_penalty must be a finite number, got {v}.", False),
    ("repetition_penalty", lambda v: v <= 0.0, lambda v: f"repetition_penalty must be greater than zero, got {v}.",
     False),
    ("temperature", lambda v: not math.isfinite(v), lambda v: f"temperature must be a finite number, got {v}.", True),
    ("temperature", lambda v: v < 0.0, lambda v: f"temperature must be non-negative, got {v}.", True),
    ("temperature", lambda v: v > 2.0, lambda v: f"temperature must be in [0, 2], got {v}.", True),
    ("top_p", lambda v: not 0.0 < v <= 1.0, lambda v: f"top_p must be in (0, 1], got {v}.", True),
    ("top_k", lambda v: v < -1, lambda v: f"top_k must be 0 (disable), or at least 1, got {v}.", False),
    ("min_p", lambda v: not 0.0 <= v <= 1.0, lambda v: f"min_p must be in [0, 1], got {v}.", False),
)


def _number(body: dict[str, Any], name: str) -> float | int | None:
    """The field as the request model holds it: a float field's number as a float, `top_k`'s integer;
    None when absent, null or not a number."""
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name in _FLOATS:
        return float(value)
    return value if isinstance(value, int) or not value.is_integer() else int(value)


def check_sampling(engine: str, dialect: EngineDialect, body: dict[str, Any]) -> ErrorReply | None:
    """vLLM's 400 for the first sampling parameter of `body` its `_verify_args` refuses (module
    docstring), else None; always None for engines outside the vLLM family."""
    if engine not in VLLM_FAMILY:
        return None
    current = dialect.api_version == "current"
    for name, refuses, message, named in _CHECKS:
        value = _number(body, name)
        if value is None or not refuses(value):
            continue
        text = message(value)
        if current and named:
            return dialect.bad_request(f"{text} (parameter={name}, value={value})", name)
        return dialect.bad_request(text)
    return None
