"""Every client API's dialect, by name and by path: `dialect_for(api)`, `dialect_for_path(path)`."""

from __future__ import annotations

from typing import Any

from gateway.dialects.base import Dialect
from gateway.dialects.chat import ChatDialect
from gateway.dialects.completions import CompletionsDialect
from gateway.dialects.messages import CountTokensDialect, MessagesDialect
from gateway.dialects.names import (
    APIS,
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    MESSAGES,
    RERANK,
    RESPONSES,
    SCORE,
)
from gateway.dialects.pooling import EmbeddingsDialect, RerankDialect, ScoreDialect
from gateway.dialects.responses import ResponsesDialect

DIALECTS: dict[str, Dialect[Any]] = {CHAT: ChatDialect(), COMPLETIONS: CompletionsDialect(),
                                     MESSAGES: MessagesDialect(), COUNT_TOKENS: CountTokensDialect(),
                                     RESPONSES: ResponsesDialect(), EMBEDDINGS: EmbeddingsDialect(),
                                     RERANK: RerankDialect(), SCORE: ScoreDialect()}
"""One stateless dialect per API (`names.APIS`)."""

assert tuple(DIALECTS) == APIS and all(d.api == name for name, d in DIALECTS.items())


def dialect_for(api: str) -> Dialect[Any]:
    """The dialect of the API named `api` (a `names.Api`). Raises KeyError for another name."""
    return DIALECTS[api]


def dialect_for_path(path: str) -> Dialect[Any]:
    """The dialect whose error shapes a client path's answers take (also for paths the gateway does
    not serve, e.g. Anthropic's batch API): Messages' under `/v1/messages`, Responses' under
    `/v1/responses`, else chat's (OpenAI's)."""
    if path.startswith(DIALECTS[MESSAGES].path):
        return DIALECTS[MESSAGES]
    return DIALECTS[RESPONSES] if path.startswith(DIALECTS[RESPONSES].path) else DIALECTS[CHAT]
