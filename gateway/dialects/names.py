"""The proxied client APIs' names. Imports nothing: the config schema and every package may use them.

Other modules name an API by these constants (or `Api`), never by a string literal
(`tests/unit/test_dialect_guard.py`); what an API means lives in its dialect (`gateway/dialects/`).
"""

from __future__ import annotations

from typing import Final, Literal

Api = Literal["chat", "completions", "messages", "count_tokens", "responses"]
"""The proxied APIs: OpenAI chat and completions, Anthropic Messages and its count_tokens, OpenAI Responses."""

CHAT: Final = "chat"
COMPLETIONS: Final = "completions"
MESSAGES: Final = "messages"
COUNT_TOKENS: Final = "count_tokens"
RESPONSES: Final = "responses"

APIS: Final[tuple[Api, ...]] = (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)
"""Every proxied API, in `Api`'s order."""
