"""The OpenAI-compatible HTTP server: the FastAPI app and running it under uvicorn."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import __version__
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.errors import OpenAIError, bad_request, install_error_handlers
from engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from engine.entrypoints.openai.serving_chat import ChatHandler, chat_prompt_ids
from engine.entrypoints.openai.serving_common import DEFAULT_MAX_BODY_BYTES, ServingContext, parse_body
from engine.entrypoints.openai.serving_completion import CompletionHandler

logger = logging.getLogger(__name__)

#: paths anyone may call even when an API key is set (load balancers probe health without a key)
OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Refuses every request but the open paths unless it carries ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
        response = OpenAIError(401, message, code="invalid_api_key").response()
        await response(scope, receive, send)


def _stats(engine: AsyncLLMEngine) -> dict[str, Any]:
    s = engine.stats()
    return {
        "num_free_blocks": s.num_free_blocks,
        "num_total_blocks": s.num_total_blocks,
        "num_requests_in_flight": s.num_requests_in_flight,
        "num_requests_total": s.num_requests_total,
        "num_steps": s.num_steps,
        "peak_batch_size": s.peak_batch_size,
        "scheduler": s.scheduler,
    }


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Create the app around a (not yet started) async engine; the app starts and stops its thread.

    Args:
        engine: the async engine to serve.
        served_model_names: names clients may put in ``model``; the engine's model name if None.
        api_key: when set, every route but ``/health`` requires ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest accepted request body.

    Returns:
        The ASGI app.
    """
    names = list(served_model_names or [engine.model_name])
    tokenizer = engine.tokenizer
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer.hf))
    ctx = ServingContext(engine=engine, served_model_names=names, vocab_size=vocab_size, max_body_bytes=max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="engine", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    chat = ChatHandler(ctx)
    completion = CompletionHandler(ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse({"status": "error", "message": "the engine loop is not running"}, status_code=503)
        return JSONResponse({"status": "ok", "model": ctx.model_name, **_stats(engine)})

    @app.get("/v1/engine/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(_stats(engine))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [
            {"id": n, "object": "model", "created": ctx.created, "owned_by": "engine", "max_model_len": engine.max_model_len}
            for n in names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await completion(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty", param="messages")
            ids = chat_prompt_ids(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    return app


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; a clean stop should exit 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        with super().capture_signals():
            yield
            stopped_by = list(self._captured_signals)
            self._captured_signals.clear()
        if stopped_by:
            logger.info("stopped by signal %s", ", ".join(str(s) for s in stopped_by))


def serve_app(app: FastAPI, host: str, port: int, graceful_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Run the app until SIGINT/SIGTERM: stop accepting, let requests in flight finish (then abort), return."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_timeout_s,
        access_log=False,
    )
    _GracefulServer(config).run()
