"""The proxied client APIs' names. Imports nothing: the config schema and every package may use them.

Other modules name an API by these constants (or `Api`), never by a string literal
(`tests/unit/test_dialect_guard.py`); what an API means lives in its dialect (`gateway/dialects/`).
"""

from __future__ import annotations

from typing import Final, Literal

Api = Literal["chat", "completions", "messages", "count_tokens", "responses", "embeddings", "rerank", "score"]
"""The proxied APIs: OpenAI chat and completions, Anthropic Messages and its count_tokens, OpenAI Responses,
and the pooling APIs (OpenAI embeddings, vLLM's rerank and score)."""

CHAT: Final = "chat"
COMPLETIONS: Final = "completions"
MESSAGES: Final = "messages"
COUNT_TOKENS: Final = "count_tokens"
RESPONSES: Final = "responses"
EMBEDDINGS: Final = "embeddings"
RERANK: Final = "rerank"
SCORE: Final = "score"

APIS: Final[tuple[Api, ...]] = (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES, EMBEDDINGS, RERANK, SCORE)
"""Every proxied API, in `Api`'s order."""

POOLING_APIS: Final[frozenset[Api]] = frozenset({EMBEDDINGS, RERANK, SCORE})
"""The APIs a pooling model serves (an embedding or cross-encoder model, vLLM's `--runner pooling`), not
a generative one: no engine kind serves them by default (`gateway/backends/engine_kinds.py`)."""

RateLimitHeaderStyle = Literal["openai", "anthropic"]
"""Whose rate-limit response headers an API's answers carry (`Dialect.rate_limit_headers`): OpenAI's
`x-ratelimit-*` or Anthropic's `anthropic-ratelimit-*` (`gateway/auth/standing.py`)."""
