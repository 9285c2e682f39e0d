"""The interface every client API's dialect implements (`Dialect`), and the rules they share.

A dialect is a stateless singleton (`registry.DIALECTS`): resolve it once per request
(`registry.dialect_for`) and read its plain attributes on hot paths (the SSE tap copies the ones
it needs at construction, so nothing per chunk goes through a dialect).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

import orjson
from pydantic import BaseModel

from gateway.dialects.names import Api, RateLimitHeaderStyle
from gateway.errors import GatewayError, error_bytes_from_upstream
from gateway.protocol.anthropic import openai_usage

if TYPE_CHECKING:
    from gateway.affinity.hashing import PrefixHasher
    from gateway.backends.engine_kinds import EngineSpec
    from gateway.config import GatewayConfig
    from gateway.routing.features import RoutingRequest
    from gateway.routing.tokens import TokenEstimator

W = TypeVar("W")


class SizeChecker(Protocol):
    """What a dialect's `check_size` needs of the body parser (`parsing.BodyParser`)."""

    config: GatewayConfig

    def check_floor(self, payload: dict[str, Any], param: str, chars: int, images: int, tokens: int,
                    output: object, messages: int | None) -> None:
        """ContextLengthExceeded when `chars` characters of text, `images` images, `tokens` more
        tokens, the output limit `output` (the body's raw value) and, with `messages`, the chat
        template's tokens for that many messages cannot fit the largest pool."""


def usage_patch(request: RoutingRequest, engine: EngineSpec) -> bool:
    """Whether the engine's body asks for usage the client did not (`backends/patches.py`): a stream
    whose client did not ask for usage, on an engine that supports `stream_options.include_usage`.
    The typed APIs (Messages, Responses) always stream their usage: their features set
    `include_usage`. The one place this rule lives."""
    return request.stream and not request.include_usage and engine.supports_include_usage


class Dialect(Generic[W]):
    """One client API: how its bodies are read and routed, what the engine gets, how its streams end
    and how its errors look. `W` is its validated wire model.

    Attributes (class-level constants):
    - `api`: its name (`names.Api`); `path`: the engine's path for it (the client's too);
      `wire_model`: the pydantic model its bodies are validated by;
    - `output_limit_field`: the body member naming its output limit (None: it generates nothing);
    - `prompt_param`: the member an error about the prompt names (`param` of context_length_exceeded);
    - `stream_end_events`: the parsed event types that end a typed stream (empty: `data: [DONE]` ends it);
      `json_error_type`: an error event is known by its data's JSON `type` too, not only an `event:` line;
    - `generates`: False for an API that only counts tokens (no token quota, its own request limit);
    - `stores_responses`: the engine may store its answers (their worker is recorded);
    - `migrates`: a broken stream may be continued on another worker (`dispatch/migration.py`);
    - `request_id_header`: the header the gateway's request id is also sent in (None: only `x-request-id`);
    - `rate_limit_headers`: whose rate-limit headers a limited key's answers carry (`auth/standing.py`).
    - `heartbeat`: what a stream of this API gets during a silence (gateway/api/heartbeat.py): an SSE
      comment by default, which every SSE client ignores.
    """

    api: ClassVar[Api]
    path: ClassVar[str]
    wire_model: ClassVar[type[BaseModel]]
    output_limit_field: ClassVar[str | None] = None
    prompt_param: ClassVar[str] = "messages"
    stream_end_events: ClassVar[tuple[bytes, ...]] = ()
    json_error_type: ClassVar[bool] = False
    generates: ClassVar[bool] = True
    stores_responses: ClassVar[bool] = False
    migrates: ClassVar[bool] = False
    request_id_header: ClassVar[bytes | None] = None
    rate_limit_headers: ClassVar[RateLimitHeaderStyle] = "openai"
    heartbeat: ClassVar[bytes] = b": keep-alive\n\n"

    # --- parsing and routing -------------------------------------------------------------------------

    def validate(self, payload: dict[str, Any]) -> W:
        """The wire model of a decoded body (`wire_model`). Raises pydantic's ValidationError."""
        return cast(W, self.wire_model.model_validate(payload))

    def model_of(self, wire: W) -> str:
        """The model name the request asks for, as sent (its `model` member)."""
        model: str = wire.model  # type: ignore[attr-defined]
        return model

    def image_urls(self, wire: W) -> list[str]:
        """The image URLs to fetch and measure (not `data:` URIs), in order, each once."""
        return []

    def features(self, wire: W, model: str, estimator: TokenEstimator, hasher: PrefixHasher | None,
                 session_key: str | None, measured: Mapping[str, tuple[int, int]] | None) -> RoutingRequest:
        """The request's routing features. Raises InvalidRequest (an image that cannot be read)."""
        raise NotImplementedError

    def check_size(self, checker: SizeChecker, payload: dict[str, Any]) -> int:
        """The count limits, then the lower bound of the tokens (`parsing` module docstring), on the
        decoded JSON before validation; the body's size in items. Raises InvalidRequest,
        ContextLengthExceeded."""
        raise NotImplementedError

    # --- the engine ----------------------------------------------------------------------------------

    def answer_usage(self, usage: dict[str, Any], cache_in_input: bool) -> dict[str, Any]:
        """A non-streamed answer's usage object in the chat names the gateway accounts by: one in
        Anthropic's names renamed (`protocol.anthropic.openai_usage`), any other as it is."""
        return openai_usage(usage, cache_in_input)

    # --- errors --------------------------------------------------------------------------------------

    def answer_status(self, status: int) -> int:
        """The HTTP status a gateway answer with `status` goes out with (the record keeps `status`)."""
        return status

    def error_bytes(self, error: GatewayError, request_id: str | None) -> bytes:
        """The gateway's error as this API's error body (OpenAI's error object by default)."""
        return error.to_bytes()

    def engine_error_bytes(self, status: int, body: bytes, code: str | None, param: str | None,
                           request_id: str | None) -> bytes:
        """An engine's 4xx answer `body` as this API's error body (`errors.error_bytes_from_upstream`;
        `code` and `param` win over the engine's)."""
        return error_bytes_from_upstream(status, body, code, param)

    def stream_error(self, message: str, code: str = "upstream_error") -> bytes:
        """The gateway's error event for a stream it cannot finish (chat and completions: one `data:`
        event holding an OpenAI error object, what the OpenAI SDKs raise on)."""
        return b"data: " + orjson.dumps({"error": server_error(message, code)}) + b"\n\n"


def server_error(message: str, code: str) -> dict[str, Any]:
    """OpenAI's error object for a failure of the gateway's (`type` "server_error")."""
    return {"message": message, "type": "server_error", "param": None, "code": code}
