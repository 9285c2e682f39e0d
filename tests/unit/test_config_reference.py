"""The configuration reference (gateway/config_reference.py, docs/config-reference.md): every key
described, the committed page equal to what the models generate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config_base import Section
from gateway.config_reference import render, undescribed
from tests.support import REPO_ROOT


def test_the_committed_page_is_what_the_config_models_generate() -> None:
    page = (REPO_ROOT / "docs" / "config-reference.md").read_text()
    assert page == render(), "regenerate: kimi-gateway config-reference > docs/config-reference.md"


def test_every_key_has_a_meaning() -> None:
    assert undescribed() == []


class Inner(Section):
    mode: Literal["a", "b"] = Field(default="a", description="which one. The rest is detail")
    tries: int = Field(default=3, ge=1, le=9, description="how many")


class Outer(Section):
    name: str = Field(description="its name")
    items: list[Inner] = Field(default_factory=list, description="the inner ones")
    inner: Inner = Field(default_factory=Inner, description="one inner")
    limit: float | None = None


def test_a_row_per_key_sections_expanded_with_types_defaults_and_first_sentences() -> None:
    page = render(Outer)
    assert "| `name` | string | required | its name |" in page
    assert "| `limit` | number or null | `null` |  |" in page
    assert "## `items[]`" in page and "## `inner`" in page
    assert '| `items[].mode` | one of `"a"`, `"b"` | `"a"` | which one |' in page
    assert "| `inner.tries` | integer (≥ 1, ≤ 9) | `3` | how many |" in page
    assert undescribed(Outer) == ["limit"]
