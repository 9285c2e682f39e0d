"""The configuration reference (docs/config-reference.md), generated from the config models.

`render()` walks `GatewayConfig` and every section it holds, depth first in declaration order,
and writes one Markdown table row per key: its dotted path (`pools[].name` for an entry of a list
of sections), its type, its default and its meaning (the first sentence of the field's
`description`). `kimi-gateway config-reference` prints it; tests/unit/test_config_reference.py
keeps the committed page equal to it, so a key added without a description, or a page not
regenerated, fails the suite.
"""

from __future__ import annotations

import enum
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config import GatewayConfig

HEADER = """# Configuration reference

Every key of the gateway's YAML config, its type, its default and what it means. Sections are
given as YAML mappings (`timeouts: {read: 120}`); `[]` marks an entry of a list (`pools[].name` is
the `name` of each item of `pools`). Unknown keys are errors. Environment variables override keys
as [Configuration](configuration.md) says; worked examples are there too.

Generated from the config models by `kimi-gateway config-reference > docs/config-reference.md`;
a test keeps this page equal to that output.
"""

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)`\]])\. (?=[A-Z(`])")


def render(model: type[BaseModel] = GatewayConfig) -> str:
    """The whole reference page for `model` (Markdown, ending in a newline)."""
    out = [HEADER]
    top = [row for row in _rows(model, "") if "." not in row[0].replace("[]", "")]
    out += ["## Top level", "", *_table(top), ""]
    for name, field in model.model_fields.items():
        if _sections(field.annotation):
            path = name + ("[]" if _is_list(field.annotation) else "")
            out += [f"## `{path}`", "", _meaning(field) or "", ""]
            rows = [row for section in _sections(field.annotation) for row in _rows(section, path + ".")]
            out += [*_table(rows), ""]
    return "\n".join(line for line in out).rstrip("\n") + "\n"


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """(path, type, default, meaning) of each key under `model`, sections expanded in place."""
    for name, field in model.model_fields.items():
        sections = _sections(field.annotation)
        path = prefix + name
        if sections:
            inner = path + ("[]" if _is_list(field.annotation) else "")
            for section in sections:
                yield from _rows(section, inner + ".")
            continue
        kind = _type(field.annotation)
        yield path, kind + _bounds(field, "characters" if kind.startswith("string") else "items"), _default(field), \
            _meaning(field)


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for path, kind, default, meaning in rows:
        lines.append(f"| `{path}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds (itself, its list's items, an optional one's)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for section in _sections(arg):
            if section not in found:
                found.append(section)
    return found


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(arg) for arg in typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS)


_UNIONS = (typing.Union, types.UnionType)


def _type(annotation: Any) -> str:
    """A field's type in words: string, integer, number, boolean, one of `a`/`b`, list of ..., ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in _UNIONS:
        named = [_type(arg) for arg in args if arg is not type(None)]
        return " or ".join(dict.fromkeys(named)) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in args)
    if origin in (list, tuple, set, frozenset):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}" if args else "mapping"
    if annotation is SecretStr:
        return "string (secret)"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(f"`{json.dumps(member.value)}`" for member in annotation)
    return {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}.get(annotation, "any")


def _bounds(field: FieldInfo, unit: str) -> str:
    """The field's numeric and length bounds (lengths in `unit`), as ` (≥ 0, ≤ 10)`."""
    marks = {annotated_types.Ge: "≥", annotated_types.Gt: ">", annotated_types.Le: "≤", annotated_types.Lt: "<",
             annotated_types.MinLen: "at least", annotated_types.MaxLen: "at most"}
    found = []
    for item in field.metadata:
        for kind, mark in marks.items():
            if isinstance(item, kind):
                value = next(iter(vars(item).values())) if hasattr(item, "__dict__") else \
                    getattr(item, item.__slots__[0])  # type: ignore[attr-defined]
                found.append(f"{mark} {value}" + (f" {unit}" if mark.startswith("at ") else ""))
    return f" ({', '.join(found)})" if found else ""


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, SecretStr):
        return "(set)"
    try:
        return f"`{json.dumps(value, ensure_ascii=False)}`"
    except TypeError:
        return f"`{value}`"


def _meaning(field: FieldInfo) -> str:
    """The first sentence of the field's description, whole."""
    text = " ".join((field.description or "").split())
    return _SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".")


def undescribed(model: type[BaseModel] = GatewayConfig) -> list[str]:
    """Paths of the keys that have no description (the reference would leave their meaning empty)."""
    return [path for path, _, _, meaning in _rows(model, "") if not meaning]
