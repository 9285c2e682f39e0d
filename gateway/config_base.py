"""Shared pieces of every config section: the strict base model, the loading error and the
validation-error explainer (one `path.to.field: message` line per problem)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A config file that cannot be loaded; the message names the offending path."""


def explain_validation_error(exc: Exception) -> str:
    """Render a pydantic ValidationError as one `path.to.field: message` line per problem."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    lines = []
    for err in errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
        lines.append(f"{loc}: {err.get('msg')}")
    return "\n".join(lines)
