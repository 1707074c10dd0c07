"""One access-log line per HTTP request: client, method, path, status, prompt and completion tokens, latency.

The middleware wraps the whole app (outermost), so refusals by the other middlewares (401, 413, ...) are
logged too. The handlers that run the model note the request's token counts in its ASGI scope with
:func:`record_usage`; the line is written when the response's last byte has been sent (for a stream: when it
ends), so its latency is the whole request's. ``engine serve --disable-log-requests`` leaves it out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("engine.access")

#: the scope key under which a request's :class:`RequestUsage` travels from the middleware to the handler
USAGE_SCOPE_KEY = "engine.usage"
#: the status logged for a client that hung up before a response started (nginx's convention): no response
#: was sent, and nothing failed on the server's side
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True)
class RequestUsage:
    """The tokens one request used, as its handler last noted them (None: not a model request)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def record_usage(request: Request, prompt_tokens: int, completion_tokens: int) -> None:
    """Note a request's token counts for its access-log line; does nothing when the log is off.

    Args:
        request: the HTTP request being served.
        prompt_tokens: tokens of the prompt (of all prompts, for a batch).
        completion_tokens: tokens generated so far (of every choice).
    """
    usage = request.scope.get(USAGE_SCOPE_KEY)
    if usage is not None:
        usage.prompt_tokens = prompt_tokens
        usage.completion_tokens = completion_tokens


def format_line(client: str, method: str, path: str, status: int, usage: RequestUsage, seconds: float) -> str:
    """The access-log line, e.g. ``127.0.0.1:50412 "POST /v1/completions" 200 prompt_tokens=5
    completion_tokens=16 0.412s``; token counts are ``-`` for requests that ran no model."""

    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    return (
        f'{client} "{method} {path}" {status} prompt_tokens={count(usage.prompt_tokens)} '
        f"completion_tokens={count(usage.completion_tokens)} {seconds:.3f}s"
    )


class AccessLogMiddleware:
    """Writes :func:`format_line` for every HTTP request, at INFO on the ``engine.access`` logger."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        usage = RequestUsage()
        scope[USAGE_SCOPE_KEY] = usage
        status = 500  # what the client gets when the app fails before it starts a response
        started_response = False
        logged = False

        def log() -> None:
            nonlocal logged
            if not logged:
                logged = True
                host, port = scope.get("client") or ("-", 0)
                seconds = time.perf_counter() - started
                logger.info("%s", format_line(f"{host}:{port}", scope["method"], scope["path"], status, usage, seconds))

        async def receive_and_watch() -> Message:
            nonlocal status
            message = await receive()
            if message["type"] == "http.disconnect" and not started_response:
                status = CLIENT_CLOSED_REQUEST
            return message

        async def send_and_watch(message: Message) -> None:
            nonlocal status, started_response
            if message["type"] == "http.response.start":
                started_response = True
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()

        try:
            await self.app(scope, receive_and_watch, send_and_watch)
        finally:
            log()  # a response cut short (client gone, error) is logged with what was known


__all__ = ["USAGE_SCOPE_KEY", "AccessLogMiddleware", "RequestUsage", "format_line", "record_usage"]
