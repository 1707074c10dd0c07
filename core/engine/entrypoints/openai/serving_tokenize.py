"""POST /tokenize and /detokenize: text or a conversation to token ids, and token ids back to text.

Neither is bounded by the context (a client counts tokens to learn whether a text fits), only by the
body limit, so their inputs can be megabytes: large ones are tokenized, detokenized and written out on
the server's tokenizing threads, and a long list of ids is written in slices, so that no single call
holds Python's global lock for long and the event loop keeps answering other requests meanwhile.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_chat import chat_prompt_ids
from engine.entrypoints.openai.serving_common import ServingContext

#: token ids written per ``json.dumps`` call (a few milliseconds each)
_IDS_PER_SLICE = 16384


class TokenizeHandler:
    """Serves /tokenize and /detokenize for one server."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, request: Request) -> Response:
        """``prompt`` (text) or ``messages`` (a conversation, rendered as chat does) to token ids.

        Raises:
            OpenAIError: 400 for neither or both of ``prompt`` and ``messages``, or a conversation the
                template refuses; 404 for an unknown model.
        """
        ctx = self.ctx
        req = await parse_body(request, TokenizeRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            ids = await ctx.off_loop(len(req.prompt), ctx.engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        elif req.messages:
            ids = await chat_prompt_ids(ctx, req.messages, req.add_generation_prompt, bounded=False)
        else:
            raise bad_request("messages must not be empty", param="messages")
        return await ctx.off_loop(len(ids), _tokens_response, ids, ctx.engine.max_model_len)

    async def detokenize(self, request: Request) -> Response:
        """``tokens`` (ids in the vocabulary) to text, special tokens included.

        Raises:
            OpenAIError: 400 for an id outside the vocabulary; 404 for an unknown model.
        """
        ctx = self.ctx
        req = await parse_body(request, DetokenizeRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        return await ctx.off_loop(len(req.tokens), self._detokenize, req.tokens)

    def _detokenize(self, tokens: list[int]) -> Response:
        self.ctx.check_token_ids(tokens, "tokens")
        return JSONResponse({"prompt": self.ctx.engine.tokenizer.decode(tokens, skip_special_tokens=False)})


def _tokens_response(ids: list[int], max_model_len: int) -> Response:
    """``{"tokens", "count", "max_model_len"}``, the ids written a slice at a time."""
    slices = [json.dumps(ids[i : i + _IDS_PER_SLICE], separators=(",", ":"))[1:-1] for i in range(0, len(ids), _IDS_PER_SLICE)]
    body = f'{{"tokens":[{",".join(slices)}],"count":{len(ids)},"max_model_len":{max_model_len}}}'
    return Response(body.encode(), media_type="application/json")
