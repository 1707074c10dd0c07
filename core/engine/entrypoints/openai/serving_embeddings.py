"""POST /v1/embeddings: OpenAI's embeddings API on the engine's pooling requests (text, a list of texts,
token ids or lists of them; ``encoding_format`` float or base64, which the openai client asks for by
default; Matryoshka ``dimensions``)."""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.async_engine import EngineDeadError
from engine.entrypoints.openai.access_log import record_usage
from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_common import (
    ServingContext,
    abort_on_disconnect,
    add_request,
    check_prompt,
    merge_streams,
    refused_as_bad_request,
    truncated,
)
from engine.input_processor import check_prompt_chars, check_text_prompt
from engine.pooling.params import PoolingParams


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]] = Field(..., examples=["The food was delicious"])
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # engine extras
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    normalize: bool | None = None
    priority: int = 0


async def pool_all(
    ctx: ServingContext, request: Request, prompts: list[list[int]], params: PoolingParams, priority: int = 0,
    model: str | None = None,
) -> list[Any]:
    """Run one pooling request per prompt and wait for all of them (aborted if the client goes away);
    ``model`` names a LoRA adapter to run them under (or the base model).

    Returns:
        The ``PoolingRequestOutput`` of each prompt, in order.

    Raises:
        OpenAIError: a refusal (400), the engine stopped (503).
    """
    base = f"pool-{uuid.uuid4().hex}"
    request_ids = [f"{base}-{i}" for i in range(len(prompts))]
    streams = []
    try:
        for rid, ids in zip(request_ids, prompts):
            streams.append(await add_request(ctx, rid, ids, params, None, None, priority, model))
    except BaseException:
        for rid in request_ids[: len(streams)]:
            ctx.engine.abort(rid)
        raise
    finals: dict[int, Any] = {}
    async with abort_on_disconnect(request, ctx.engine, request_ids):
        try:
            async for i, output in merge_streams(streams):
                finals[i] = output
        except EngineDeadError as exc:
            raise OpenAIError(503, str(exc), code="engine_unavailable") from None
    if len(finals) < len(prompts):
        raise OpenAIError(503, "the request was aborted before it was computed", code="aborted")
    record_usage(request, sum(len(ids) for ids in prompts), 0)
    return [finals[i] for i in range(len(prompts))]


class EmbeddingsHandler:
    """Serves embeddings for one server."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        raw = req.input
        if isinstance(raw, str):
            batch: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            batch = [raw]
        else:
            batch = list(raw)
        if not batch:
            raise bad_request("input must not be empty", param="input")
        self.ctx.limits.check_num_prompts(len(batch))
        tokenizer, out = self.ctx.engine.tokenizer, []
        for item in batch:
            if isinstance(item, str):
                with refused_as_bad_request():
                    check_text_prompt(item)
                    check_prompt_chars(len(item), self.ctx.engine.max_model_len, tokenizer.max_token_chars)
                ids = tokenizer.encode(item, add_special_tokens=True)
            else:
                ids = list(item)
            ids = truncated(ids, req.truncate_prompt_tokens)
            check_prompt(ids, None, self.ctx.engine.max_model_len, self.ctx.vocab_size, "input")
            out.append(ids)
        return out

    async def __call__(self, request: Request) -> JSONResponse:
        ctx = self.ctx
        req = await parse_body(request, EmbeddingRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        raw = req.input
        size = len(raw) if isinstance(raw, str) else sum(len(x) if isinstance(x, (str, list)) else 1 for x in raw)
        prompts = await ctx.off_loop(size, self._prompts, req)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        finals = await pool_all(ctx, request, prompts, params, req.priority, req.model)
        num_tokens = sum(len(ids) for ids in prompts)
        data = []
        for i in range(len(prompts)):
            vector = finals[i].outputs.data.float().numpy().astype(np.float32)
            embedding: Any = base64.b64encode(vector.tobytes()).decode() if req.encoding_format == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return JSONResponse({
            "object": "list", "data": data, "model": ctx.reported_model(req.model),
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        })  # fmt: skip
