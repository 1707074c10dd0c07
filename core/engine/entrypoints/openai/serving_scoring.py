"""POST /classify, /score, /rerank (also /v1/score, /v1/rerank, /v2/rerank) and /pooling, in the leading
engine's request and response shapes, on pooling requests of a sequence-classification model (or, for
/pooling, of any model)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_common import ServingContext, check_prompt, refused_as_bad_request
from engine.entrypoints.openai.serving_embeddings import pool_all
from engine.input_processor import check_text_prompt
from engine.pooling.params import PoolingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    priority: int = 0


class ClassifyRequest(_Body):
    input: str | list[str] = Field(..., examples=["I loved it"])


class ScoreRequest(_Body):
    text_1: str | list[str] = Field(..., examples=["What is the capital of France?"])
    text_2: str | list[str] = Field(..., examples=[["Paris is the capital.", "Bananas are yellow."]])


class RerankRequest(_Body):
    query: str = Field(..., examples=["What is the capital of France?"])
    documents: list[str] = Field(..., min_length=1, examples=[["Paris is the capital.", "Bananas are yellow."]])
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


class PoolingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]] = Field(..., examples=["The food was delicious"])
    normalize: bool | None = None
    dimensions: int | None = Field(None, ge=1)
    #: ``embed``: one pooled vector (the default); ``token_embed``: every token's hidden state; ``classify`` /
    #: ``token_classify``: the classification head's probabilities, on the pooled state or on every token
    task: Literal["embed", "token_embed", "classify", "token_classify"] = "embed"


class ScoringHandler:
    """Serves the scoring routes for one server."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _text_ids(self, text: str, param: str) -> list[int]:
        with refused_as_bad_request():
            check_text_prompt(text)
        ids = self.ctx.engine.tokenizer.encode(text, add_special_tokens=True)
        check_prompt(ids, None, self.ctx.engine.max_model_len, self.ctx.vocab_size, param)
        return ids

    def _pair_ids(self, first: str, second: str) -> list[int]:
        ids = self.ctx.engine.tokenizer.encode_pair(first, second)
        check_prompt(ids, None, self.ctx.engine.max_model_len, self.ctx.vocab_size, "text_2")
        return ids

    def _envelope(self, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
        return {
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": self.ctx.model_name,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip

    async def classify(self, request: Request) -> JSONResponse:
        req = await parse_body(request, ClassifyRequest, self.ctx.max_body_bytes)
        self.ctx.check_base_model(req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts:
            raise bad_request("input must not be empty", param="input")
        prompts = [self._text_ids(t, "input") for t in texts]
        outs = await pool_all(self.ctx, request, prompts, PoolingParams(task="classify"), req.priority)
        labels = self.ctx.engine.label_names
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels.get(best, f"LABEL_{best}"), "probs": probs, "num_classes": len(probs)})
        return JSONResponse(self._envelope(data, sum(len(p) for p in prompts)))

    async def score(self, request: Request) -> JSONResponse:
        req = await parse_body(request, ScoreRequest, self.ctx.max_body_bytes)
        self.ctx.check_base_model(req.model)
        firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if not firsts or not seconds:
            raise bad_request("text_1 and text_2 must not be empty", param="text_1" if not firsts else "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise bad_request(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1 or as many as text_2", param="text_1")
        prompts = [self._pair_ids(a, b) for a, b in zip(firsts, seconds)]
        outs = await pool_all(self.ctx, request, prompts, PoolingParams(task="classify"), req.priority)
        data = [{"index": i, "object": "score", "score": out.outputs.score} for i, out in enumerate(outs)]
        return JSONResponse(self._envelope(data, sum(len(p) for p in prompts)))

    async def rerank(self, request: Request) -> JSONResponse:
        req = await parse_body(request, RerankRequest, self.ctx.max_body_bytes)
        self.ctx.check_base_model(req.model)
        prompts = [self._pair_ids(req.query, d) for d in req.documents]
        outs = await pool_all(self.ctx, request, prompts, PoolingParams(task="classify"), req.priority)
        ranked = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[: req.top_n]
        results = [
            {"index": i, "relevance_score": outs[i].outputs.score, **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
            for i in ranked
        ]
        tokens = sum(len(p) for p in prompts)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": self.ctx.model_name, "usage": {"total_tokens": tokens}, "results": results})

    async def pooling(self, request: Request) -> JSONResponse:
        req = await parse_body(request, PoolingRequest, self.ctx.max_body_bytes)
        self.ctx.check_base_model(req.model)
        raw = req.input
        items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise bad_request("input must not be empty", param="input")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(self._text_ids(item, "input"))
            else:
                check_prompt(list(item), None, self.ctx.engine.max_model_len, self.ctx.vocab_size, "input")
                prompts.append(list(item))
        params = PoolingParams(
            normalize=req.normalize, dimensions=req.dimensions, task="classify" if req.task.endswith("classify") else "embed",
            pooling_type="ALL" if req.task.startswith("token_") else None,
        )  # fmt: skip
        outs = await pool_all(self.ctx, request, prompts, params, req.priority)
        data = [{"index": i, "object": "pooling", "data": out.outputs.embedding} for i, out in enumerate(outs)]
        return JSONResponse(self._envelope(data, sum(len(p) for p in prompts)))
