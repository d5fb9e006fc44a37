"""Errors as the API answers them: an `ErrorResponse` of one line, 400 for malformed JSON, 422
for other invalid input, never the input echoed."""

import json
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrieval_server.api import (
    ErrorResponse,
)

MAX_LOC_CHARS = 64  # a validation error names the field, cut to this; input is never echoed


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped, so text that is not valid UTF-8 (a lone surrogate in a
    field name) can never fail the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    return SafeJSONResponse(ErrorResponse(detail=detail).model_dump(), status, headers=headers)


def _location(loc: Any) -> list[str | int]:
    """An error location without "body", each part cut to MAX_LOC_CHARS."""
    parts = loc if isinstance(loc, (list, tuple)) else [loc]
    return [
        part if isinstance(part, int) else str(part)[:MAX_LOC_CHARS]
        for part in parts
        if part != "body"
    ]


def validation_message(exc: RequestValidationError) -> str:
    """One line from the first validation error: 'queries.3: String should have at most ...'."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        position = first.get("loc", ("body", "?"))[-1]
        reason = first.get("ctx", {}).get("error", "not valid JSON")
        return f"malformed JSON body at character {position}: {reason}"
    where = ".".join(str(part) for part in _location(first.get("loc", ())))
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where or 'request'}: {first.get('msg', 'invalid')}{more}"


def install_error_handlers(app: FastAPI) -> None:
    """Errors as `ErrorResponse`: malformed JSON is a 400, other invalid input a 422. The
    offending input is never echoed (it may be huge, or not encodable)."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> Response:
        status = 400 if any(e.get("type") == "json_invalid" for e in exc.errors()) else 422
        errors = [
            {"loc": _location(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
            for e in exc.errors()[:20]
        ]
        body = ErrorResponse(detail=validation_message(exc), errors=jsonable_encoder(errors))
        return SafeJSONResponse(body.model_dump(), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)
