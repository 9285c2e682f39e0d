"""`${NAME}` / `${NAME:-default}` interpolation and `KIMI_GATEWAY_<FIELD>` overrides of a config
tree. Both read one explicit mapping (`environ`): nothing here reads the process environment."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from gateway.config_base import ConfigError

ENV_PREFIX = "KIMI_GATEWAY_"
"""Prefix of the variables overriding top-level fields (`KIMI_GATEWAY_PORT`)."""

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
"""A `${NAME}` or `${NAME:-default}` reference in a string value: group 1 the name, group 2 the default."""


def interpolate_env(value: Any, environ: Mapping[str, str]) -> Any:
    """Replace `${NAME}` / `${NAME:-default}` in every string of a parsed YAML tree.

    Raises ConfigError naming every referenced variable that is unset and has no default, each
    with its config path (`pools.0.api_key: ${VLLM_KEY}`).
    """
    missing: list[str] = []
    result = _interpolate(value, environ, "", missing)
    if missing:
        raise ConfigError("environment variables not set (and no ${NAME:-default}): " + "; ".join(missing))
    return result


def _interpolate(value: Any, environ: Mapping[str, str], path: str, missing: list[str]) -> Any:
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            missing.append(f"{path or '(top level)'}: {match.group(0)}")
            return ""

        return ENV_REF.sub(sub, value)
    if isinstance(value, list):
        return [_interpolate(v, environ, f"{path}.{i}" if path else str(i), missing) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _interpolate(v, environ, f"{path}.{k}" if path else str(k), missing) for k, v in value.items()}
    return value


def env_overrides(environ: Mapping[str, str], model: type[BaseModel]) -> dict[str, Any]:
    """The top-level fields of `model` that `environ` overrides: `KIMI_GATEWAY_<FIELD>` (any case) → value.

    Scalars are taken as strings (pydantic converts them); sections and lists (`KIMI_GATEWAY_AUTH`,
    `KIMI_GATEWAY_POOLS`) are JSON. Variables naming no field are ignored. Raises ConfigError for
    JSON that does not parse.
    """
    given = {name.upper(): value for name, value in environ.items() if name.upper().startswith(ENV_PREFIX)}
    overrides: dict[str, Any] = {}
    for field, info in model.model_fields.items():
        variable = ENV_PREFIX + field.upper()
        if variable not in given:
            continue
        if not _is_complex(info.annotation):
            overrides[field] = given[variable]
            continue
        try:
            overrides[field] = json.loads(given[variable])
        except ValueError as exc:
            raise ConfigError(f"{variable} is not valid JSON ({exc}); complex {ENV_PREFIX}* overrides are JSON") \
                from exc
    return overrides


def _is_complex(annotation: Any) -> bool:
    """A section, list or mapping (also inside `X | None`): given as JSON in the environment."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    if get_origin(annotation) in (list, dict):
        return True
    return get_origin(annotation) in (Union, UnionType) and any(_is_complex(a) for a in get_args(annotation))


def deep_update(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `update` merged in: mappings merged key by key, any other value replaced."""
    merged = dict(base)
    for key, value in update.items():
        old = merged.get(key)
        merged[key] = deep_update(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged
