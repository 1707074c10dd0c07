"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.

Every way a request can fail ends here, so that a client mistake is a 4xx with a readable message and
only the server's own bugs are a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}

# pydantic marks which branch of a union failed with the branch's type name; users never wrote those.
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "function-after", "function-before")


class OpenAIError(Exception):
    """An error response the handlers raise; the app turns it into OpenAI's JSON.

    Args:
        status: HTTP status code.
        message: one line for the user.
        param: the request field to blame, if any.
        code: a short machine-readable code, if any.
        type: OpenAI's error type; derived from ``status`` when None.
        headers: extra response headers (``Retry-After`` on a 503, ``Connection: close`` on a 408).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **(self.headers or {})})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first problem pydantic found, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    loc = [part for part in first.get("loc", ()) if not _is_union_tag(part)]
    if loc and loc[0] == "body":  # FastAPI prefixes body fields with "body"
        loc = loc[1:]
    path = _format_loc(loc)
    message = first.get("msg", "invalid value")
    if path:
        message = f"{path}: {message}"
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(message + extra, param=str(loc[0]) if loc else None)


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part[:1].isupper())


def _format_loc(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through :class:`OpenAIError`."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "HTTP error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return OpenAIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not the client's: log it with its traceback and answer 500.
        logger.exception("unhandled error for %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal server error: {type(exc).__name__}", type="server_error").response()
