"""Small JSON answers (orjson) for the non-proxied endpoints and the middlewares: a low-level HTTP
helper, importable from any package (it needs only gateway.errors)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from gateway.errors import GatewayError


class JSONResponse(Response):
    """A Starlette response rendered with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: GatewayError) -> JSONResponse:
    """An OpenAI error object with the error's status and headers."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
