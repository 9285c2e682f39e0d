"""Which models an API key may use, by name (issue 22): a key's `models` and `model_limits` entries
resolved to the names requests resolve to.

A request's `model` is resolved by `gateway/parsing.py` (`BodyParser.validate`) to its model's
canonical name (an alias, case-insensitively, is its model) or, for a LoRA adapter, the adapter's
name exactly as the engines list it. A key's entries are resolved the same way once, when the key
ring is built, so `alias`, `ALIAS` and the canonical name all grant the same model, and a request
is checked with one set lookup (`Principal.may_use`). A name no model has is kept as it is: a LoRA
adapter's, declared in a pool or listed by its engines later (discovered adapters are not known
when the key ring is built).

`model_names` is the one place that reads the config's models (`model:` or `models:`) for auth:
the names `RoutingRequest.model` can carry, apart from adapters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gateway.config import GatewayConfig

NOT_FOUND = "The model `{}` does not exist or you do not have access to it."
"""OpenAI's wording for a model that does not exist or that the key has no access to (the same
answer for both, so a key cannot learn which models exist beyond its own)."""


def model_names(config: GatewayConfig) -> dict[str, str]:
    """Every configured model name and alias, lower-cased → its model's canonical name (how
    `BodyParser.validate` resolves a request's `model`)."""
    return {name.lower(): model.name for model in config.served_models() for name in model.names()}


def canonical(name: str, names: Mapping[str, str]) -> str:
    """The name requests for `name` resolve to: its model's canonical name when `name` is a model's
    name or alias (any case; `names` from `model_names`), else `name` itself (a LoRA adapter)."""
    return names.get(name.lower(), name)


def allowed_models(models: Iterable[str] | None, names: Mapping[str, str]) -> frozenset[str] | None:
    """A key's `models` entries as the names its requests resolve to (`canonical`); None: all."""
    return None if models is None else frozenset(canonical(m, names) for m in models)


def model_not_found_message(name: str) -> str:
    """OpenAI's 404 `model_not_found` message for `name` (cut to 200 characters, as elsewhere)."""
    return NOT_FOUND.format(name[:200])
