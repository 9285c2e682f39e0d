"""Structured output in the simulator: the JSON answer a request's format asks for, and what the engines
refuse about that format.

Formats read (vLLM 0.32.0, which turns each into the same structured-output constraint, so the model's
answer is JSON of that shape: `vllm/entrypoints/openai/chat_completion/protocol.py`
`extract_structured_outputs`; `vllm/entrypoints/openai/responses/protocol.py`; the Messages layer's
`_handle_output_config` in `vllm/entrypoints/anthropic/serving.py`):

- chat `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema"}}`;
- Responses `text.format`: `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema"}`;
- Messages `output_config.format`: `{"type": "json_schema", "schema"}` (vLLM only; a format without a
  schema leaves the answer free).

The simulator's model answers the least JSON the format allows (`instance`): `{}` for `json_object`;
for a schema an object with its `required` properties, each the least value of its type ("" for a
string, 0, false, [] or an array of `minItems` least items, null, an enum's or a `const`'s value, an
`anyOf`/`oneOf`/`allOf`'s first branch). `json.dumps` text, sent as a scripted text is
(`gateway.sim.script`: a word per output token); cut by the token limit as any answer is (then it does
not parse, as a real one cut short).

Refusals (vLLM 0.32.0, as recorded in tests/real_vllm/vllm-0.32.0.json):
- `json_schema` without its `json_schema`: 400 `BadRequestError` "When response_format type is
  'json_schema', the 'json_schema' field must be provided." (`validate_response_format`, a
  `VLLMValidationError` with `parameter=response_format`);
- a `type` outside text/json_object/json_schema/structural_tag, or a `schema` that is no object: the
  request model's validation error (FastAPI's 400 "Bad Request", `tokens.FieldValidationError`), which
  names every branch of the `response_format` union it tried (`AnyResponseFormat`).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.sim.tokens import FieldValidationError, PromptError


class ParameterError(PromptError):
    """A `VLLMValidationError` naming the request field it refuses (`parameter`): 400 with that `param`."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(f"{message} (parameter={parameter})")
        self.parameter = parameter


_STRUCTURAL_TAG_BRANCHES = (("format",), ("structures", "triggers"))
"""The required fields of the `response_format` union's structural-tag models, in the union's order."""
_MOST = 64  # a `minLength` / `minItems` beyond is filled this far only (a schema must not size the answer)


def instance(schema: Any, depth: int = 0) -> Any:
    """The least JSON value `schema` allows (module docstring); `{}` for what it does not understand."""
    if not isinstance(schema, dict) or depth > 16:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return instance(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind == "string":
        return "x" * min(schema["minLength"], _MOST) if isinstance(schema.get("minLength"), int) else ""
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        base = low if isinstance(low, (int, float)) and not isinstance(low, bool) and low > 0 else 0
        return int(base) + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "array":
        count = min(schema["minItems"], _MOST) if isinstance(schema.get("minItems"), int) else 0
        return [instance(schema.get("items"), depth + 1) for _ in range(count)]
    properties, required = schema.get("properties"), schema.get("required")
    properties = properties if isinstance(properties, dict) else {}
    required = required if isinstance(required, list) else []
    return {name: instance(properties.get(name), depth + 1) for name in required if isinstance(name, str)}


def answer_text(value: Any) -> str:
    """The answer's text: compact JSON as `json.dumps` writes it."""
    return json.dumps(value)


def _format_errors(fmt: dict[str, Any], loc: tuple[str, ...]) -> list[dict[str, Any]]:
    """pydantic's errors for a `response_format` none of the union's branches accepts: the branch of
    its type (or the type literal) first, then each `structural_tag` branch's complaints."""
    kind = fmt.get("type")
    errors: list[dict[str, Any]] = []
    if kind in ("text", "json_object", "json_schema"):
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        errors.append({"type": "dict_type", "loc": (*loc, "json_schema", "schema"),
                       "msg": "Input should be a valid dictionary", "input": schema})
    else:
        errors.append({"type": "literal_error", "loc": (*loc, "type"),
                       "msg": "Input should be 'text', 'json_object' or 'json_schema'", "input": kind,
                       "ctx": {"expected": "'text', 'json_object' or 'json_schema'"}})
    tag = {"type": "literal_error", "loc": (*loc, "type"), "msg": "Input should be 'structural_tag'", "input": kind,
           "ctx": {"expected": "'structural_tag'"}}
    for fields in _STRUCTURAL_TAG_BRANCHES:  # each structural-tag model: its type, then its missing fields
        errors.append(tag)
        errors.extend({"type": "missing", "loc": (*loc, field), "msg": "Field required", "input": fmt}
                      for field in fields)
    return errors


def chat_format(body: dict[str, Any]) -> Any:
    """The schema a chat request's `response_format` constrains its answer to (`{}` standing for any
    object with `json_object`), or None for a free answer. Raises ParameterError and
    FieldValidationError as vLLM refuses the format (module docstring)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise FieldValidationError([{"type": "model_attributes_type", "loc": ("body", "response_format"),
                                     "msg": "Input should be a valid dictionary or object to extract fields from",
                                     "input": fmt}])
    kind = fmt.get("type")
    if kind == "structural_tag":
        return None  # a tag grammar: the simulator's filler answer stands for it
    if kind not in ("text", "json_object", "json_schema"):
        raise FieldValidationError(_format_errors(fmt, ("body", "response_format")))
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if spec is None:
        raise ParameterError("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                             "response_format")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if "schema" in (spec if isinstance(spec, dict) else {}) and not isinstance(schema, dict):
        raise FieldValidationError(_format_errors(fmt, ("body", "response_format")))
    return schema if isinstance(schema, dict) else {"type": "object"}


def responses_format(body: dict[str, Any]) -> Any:
    """The schema a Responses request's `text.format` constrains its answer to, or None."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        return fmt.get("schema") if isinstance(fmt.get("schema"), dict) else {"type": "object"}
    return None


def messages_format(body: dict[str, Any]) -> Any:
    """The schema a Messages request's `output_config.format` constrains its answer to, or None (vLLM
    applies only a format with a schema)."""
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    return schema if isinstance(schema, dict) and schema else None
