"""The OpenAI-compatible HTTP server: the FastAPI app and running it under uvicorn."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware

from engine import __version__
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.access_log import AccessLogMiddleware
from engine.entrypoints.openai.errors import install_error_handlers
from engine.entrypoints.openai.lifecycle import GracefulServer, header_deadline_protocol
from engine.entrypoints.openai.limits import RequestLimits
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.middleware import (
    ApiKeyMiddleware,
    HostCheckMiddleware,
    RequestBodyMiddleware,
    RequestIdMiddleware,
)
from engine.entrypoints.openai.openapi import install_openapi, request_body
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.request_body import DEFAULT_MAX_BODY_BYTES
from engine.entrypoints.openai.serving_chat import ChatHandler
from engine.entrypoints.openai.serving_common import ServingContext
from engine.entrypoints.openai.serving_completion import CompletionHandler
from engine.entrypoints.openai.serving_embeddings import EmbeddingRequest, EmbeddingsHandler
from engine.entrypoints.openai.serving_messages import MessagesHandler
from engine.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
    check_lora_names,
)
from engine.entrypoints.openai.serving_responses import ResponsesHandler
from engine.entrypoints.openai.serving_scoring import (
    ClassifyRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    ScoringHandler,
)
from engine.entrypoints.openai.serving_tokenize import TokenizeHandler
from engine.entrypoints.openai.serving_tools import ChatParsers
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

#: paths anyone may call even when an API key is set (load balancers probe health without a key)
OPEN_PATHS = frozenset({"/health", "/ping"})
#: seconds a connection has to complete each request's headers
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: seconds a client has, after its headers, to send the whole request body
DEFAULT_BODY_TIMEOUT_S = 30.0


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


def engine_version() -> str:
    """The installed ``engine`` distribution's version (the package's own when it runs from a source tree)."""
    try:
        return importlib.metadata.version("engine")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    access_log: bool = True,
    allow_special_tokens_in_messages: bool = False,
    chat_parsers: ChatParsers | None = None,
    lora_requests: Sequence[LoRARequest] = (),
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """Create the app around a (not yet started) async engine; the app starts and stops its thread.

    Args:
        engine: the async engine to serve.
        served_model_names: names clients may put in ``model``; the engine's model name if None.
        api_key: when set, every route but ``/health`` requires ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest accepted request body.
        limits: how much work one request may ask for (defaults: :class:`RequestLimits`).
        allowed_hosts: ``Host`` names accepted (see ``middleware.default_allowed_hosts``); None: any.
        allowed_origins: web origins allowed to call the API from a browser (CORS); None: none.
        body_timeout_s: seconds a client has, after its headers, to send its request body.
        access_log: log one line per request (logger ``engine.access``); ``--disable-log-requests`` turns it off.
        allow_special_tokens_in_messages: read special-token strings typed in chat messages as special
            tokens, as the template's own markers are (trusted clients only; off: they stay plain text).
        chat_parsers: the tool-call and reasoning parsers chat responses are read with
            (``--tool-call-parser``, ``--enable-auto-tool-choice``, ``--reasoning-parser``); None: none.
        lora_requests: LoRA adapters the engine has registered (``--lora-modules``), served under their
            names: the ``model`` field selects them and ``/v1/models`` lists them.
        allow_runtime_lora_updating: add ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
            (the engine must run with LoRA enabled).

    Returns:
        The ASGI app. Its :class:`ServerMetrics` (``GET /metrics``) is ``app.state.metrics``; it becomes
        the engine's request observer, replacing any set before.

    Raises:
        ValueError: an adapter's name is the base model's or another adapter's.
    """
    names = list(served_model_names or [engine.model_name])
    check_lora_names(lora_requests, names)
    tokenizer = engine.tokenizer
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer.hf))
    ctx = ServingContext(
        engine=engine, served_model_names=names, vocab_size=vocab_size, max_body_bytes=max_body_bytes,
        allow_special_tokens_in_messages=allow_special_tokens_in_messages,
        generation_defaults=dict(engine.generation_defaults),
        lora_requests={lora.lora_name: lora for lora in lora_requests},
    )  # fmt: skip
    ctx.limits = (limits or RequestLimits()).resolved(engine.max_model_len)
    metrics = ServerMetrics(engine, ctx.model_name, engine.max_model_len)
    engine.observer = metrics.tracker
    version = engine_version()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # What is loaded by now (torch, the model, the libraries) lives as long as the server: a full
        # garbage collection walking it held the global lock for about 0.1 s, and requests that allocate
        # much trigger one at any time. Frozen, collections walk only what requests create.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            engine.shutdown()
            ctx.executor.shutdown(wait=False, cancel_futures=True)

    # the request schema (bodies included, see openapi.py) at /openapi.json, browsable at /docs
    app = FastAPI(title="engine", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.metrics = metrics
    install_error_handlers(app)
    # the last added runs first: the Host check, then CORS (whose preflights carry no key), then the key
    app.add_middleware(RequestBodyMiddleware, timeout_s=body_timeout_s)
    app.add_middleware(RequestIdMiddleware)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )  # fmt: skip
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)
    if access_log:
        # added last, so it runs first and logs what every other middleware answers too
        app.add_middleware(AccessLogMiddleware)
    chat = ChatHandler(ctx, chat_parsers)
    completion = CompletionHandler(ctx)
    tokenizing = TokenizeHandler(ctx)
    anthropic_messages = MessagesHandler(chat)
    responses = ResponsesHandler(chat)
    embeddings = EmbeddingsHandler(ctx)
    scoring = ScoringHandler(ctx)
    models_handler = OpenAIServingModels(ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse({"status": "error", "message": "the engine loop is not running"}, status_code=503)
        return JSONResponse({"status": "ok", "model": ctx.model_name, **_stats(engine)})

    @app.get("/v1/engine/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(_stats(engine))

    # Prometheus' text format (docs/metrics.md); behind the API key like every route but the probes
    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_info() -> JSONResponse:
        return JSONResponse({"version": version})

    # the SageMaker-style probe other engines answer: the same as /health
    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> JSONResponse:
        return await health()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_handler.show_available_models())

    # ``:path`` because a served name may hold slashes (``HuggingFaceTB/SmolLM2-135M-Instruct``)
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        ctx.check_model(model_id)
        return JSONResponse(models_handler.model_card(model_id))

    body_models: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest]
    # not mounted otherwise: the routes answer 404 as any unknown path does
    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest))
        async def load_lora_adapter(request: Request) -> Response:
            return await models_handler.load_lora_adapter(request)

        @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest))
        async def unload_lora_adapter(request: Request) -> Response:
            return await models_handler.unload_lora_adapter(request)

        body_models += [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        return await chat(request)

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def create_embeddings(request: Request) -> Response:
        return await embeddings(request)

    # the leading engine's scoring routes (sequence-classification models; /pooling for any model)
    @app.post("/classify", openapi_extra=request_body(ClassifyRequest))
    async def classify(request: Request) -> Response:
        return await scoring.classify(request)

    @app.post("/score", openapi_extra=request_body(ScoreRequest))
    @app.post("/v1/score", openapi_extra=request_body(ScoreRequest))
    async def score(request: Request) -> Response:
        return await scoring.score(request)

    @app.post("/rerank", openapi_extra=request_body(RerankRequest))
    @app.post("/v1/rerank", openapi_extra=request_body(RerankRequest))
    @app.post("/v2/rerank", openapi_extra=request_body(RerankRequest))
    async def rerank(request: Request) -> Response:
        return await scoring.rerank(request)

    @app.post("/pooling", openapi_extra=request_body(PoolingRequest))
    async def pooling(request: Request) -> Response:
        return await scoring.pooling(request)

    # OpenAI's Responses API, stateless, served by the chat pipeline
    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        return await responses(request)

    # Anthropic's Messages API, served by the chat pipeline (its errors in Anthropic's shape)
    @app.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
    async def messages(request: Request) -> Response:
        return await anthropic_messages.messages(request)

    @app.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        return await anthropic_messages.count_tokens(request)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Any:
        return await completion(request)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await tokenizing.tokenize(request)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await tokenizing.detokenize(request)

    install_openapi(app, body_models)
    return app


def serve_app(
    app: FastAPI,
    host: str,
    port: int,
    graceful_timeout_s: float = 30.0,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    abort_in_flight: Callable[[], None] | None = None,
) -> None:
    """Run the app until SIGINT/SIGTERM: stop accepting, let requests in flight finish, abort the rest, return.

    Args:
        app: the app from :func:`build_app`.
        host: address to bind.
        port: port to bind.
        graceful_timeout_s: seconds the requests in flight may run on after the signal.
        log_level: uvicorn's log level.
        header_timeout_s: seconds a connection has to complete each request's headers.
        abort_in_flight: aborts every request in flight once the grace period is over, so that each
            response ends properly (``AsyncLLMEngine.abort_all``); None cuts them as uvicorn does.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=header_deadline_protocol(header_timeout_s),
    )
    GracefulServer(config, graceful_timeout_s, abort_in_flight).run()
