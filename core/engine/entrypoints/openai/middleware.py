"""The server's ASGI middlewares: the API key, the ``Host`` check and the request-body deadline.

They are plain ASGI callables rather than Starlette's ``BaseHTTPMiddleware``, which runs every response
through an extra task and memory stream and so costs streamed responses on every chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Iterable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

#: names a browser uses for this machine; with the bound host, the default ``Host`` allow-list
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
#: methods whose requests carry no body to wait for
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


class ApiKeyMiddleware:
    """Refuses every request but the open paths unless it carries ``Authorization: Bearer <key>`` (or, as
    Anthropic's clients send it, ``x-api-key: <key>``).

    The scheme is matched case-insensitively (RFC 9110 makes it so); the key is compared in constant
    time.

    Args:
        app: the wrapped app.
        api_key: the key clients must send.
        open_paths: paths served without a key.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        scheme, _, token = given.strip().partition(b" ")
        # compare_digest runs over the whole key even when the scheme is wrong, so that timing says nothing
        key_matches = hmac.compare_digest(token.strip(), self._key)
        if key_matches and scheme.lower() == b"bearer":
            await self.app(scope, receive, send)
            return
        # Anthropic's clients send the key in x-api-key
        anthropic_key = _header(scope, b"x-api-key")
        if anthropic_key and hmac.compare_digest(anthropic_key.strip(), self._key):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
        await OpenAIError(401, message, code="invalid_api_key").response()(scope, receive, send)


class HostCheckMiddleware:
    """Refuses requests whose ``Host`` header names a host not on the allow-list (400).

    A web page can point a name it controls at 127.0.0.1 (DNS rebinding) and so talk to a local server
    as if it were its own origin; the browser still sends the page's name in ``Host``, which is what this
    catches.

    Args:
        app: the wrapped app.
        allowed_hosts: host names (no port), compared case-insensitively; IPv6 addresses in brackets.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str]) -> None:
        self.app = app
        self._allowed = frozenset(normalize_host(h) for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        raw = _header(scope, b"host").decode("latin-1")
        if normalize_host(raw) in self._allowed:
            await self.app(scope, receive, send)
            return
        message = f"the Host header {raw!r} is not allowed; start the server with --allowed-hosts to allow it"
        await OpenAIError(400, message, code="invalid_host").response()(scope, receive, send)


class RequestBodyMiddleware:
    """Bounds the time a client may take to send its request body; a hang-up mid-body is one log line.

    uvicorn waits for a body as long as the client keeps the connection open, so a client sending a
    byte now and then holds a connection and a task forever. Here the body must be complete within
    ``timeout_s`` of the request's headers: otherwise the request is answered 408 and the connection
    closed. A client that disconnects before its body is complete is logged in one line instead of
    the two tracebacks the framework would print.

    Args:
        app: the wrapped app.
        timeout_s: seconds from the end of the headers to the end of the body.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def receive_body() -> Message:
            nonlocal body_done
            if body_done:  # after the body, receive() only waits for the disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                logger.info("%s: the request body took over %gs; answered 408", _describe(scope), self.timeout_s)
                raise OpenAIError(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g}s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        try:
            await self.app(scope, receive_body, send)
        except ClientDisconnect:
            # nobody is left to answer; the framework would log two tracebacks for this
            logger.info("%s: the client hung up before sending its whole request body", _describe(scope))


def default_allowed_hosts(bind_host: str, api_key: str | None, configured: Iterable[str] | None) -> list[str] | None:
    """The ``Host`` names the server accepts, or None for any.

    Args:
        bind_host: the address the server listens on.
        api_key: the server's API key, if any.
        configured: ``--allowed-hosts`` as given (``*`` allows any host), or None when not given.

    Returns:
        The configured list when given; else, for a server on a loopback address without an API key,
        the loopback names and the bound host; else None (a key already keeps other pages out, and a
        server on a public address is reachable without any trick).
    """
    if configured is not None:
        names = [h.strip() for h in configured if h.strip()]
        return None if "*" in names else names
    if api_key or not is_loopback(bind_host):
        return None
    return [*LOOPBACK_NAMES, bind_host]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback interface."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def normalize_host(host: str) -> str:
    """``Host`` header value or host name -> the lower-case name without port or trailing dot.

    ``[::1]:8000`` -> ``[::1]``, ``::1`` -> ``[::1]``, ``LocalHost.:80`` -> ``localhost``.
    """
    value = host.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    if value.count(":") > 1:  # a bare IPv6 address, as a configured name may be written
        return f"[{value}]"
    return value.partition(":")[0].rstrip(".")


class RequestIdMiddleware:
    """Echoes a request's ``X-Request-Id`` header on its response (at most 256 printable ASCII bytes), so a
    caller or proxy can match the two, whatever the route and also for error responses."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = _header(scope, b"x-request-id")[:256] if scope["type"] == "http" else b""
        if not given or not all(0x20 <= byte < 0x7F for byte in given):
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""


def _describe(scope: Scope) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "a client"
    return f"{who} {scope.get('method', '')} {scope.get('path', '')}"
