"""POST /v1/chat/completions: a conversation in, the assistant's reply out (whole or streamed)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from engine.async_engine import EngineDeadError, RequestStream
from engine.chat_input import encode_conversation
from engine.entrypoints.openai.access_log import record_usage
from engine.entrypoints.openai.content_parts import check_content_parts
from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.request_fields import UNSUPPORTED_CHAT_FIELDS, check_extra_fields
from engine.entrypoints.openai.serving_common import (
    DeltaTracker,
    ServingContext,
    TokenLogprobs,
    abort_on_disconnect,
    add_request,
    check_prompt,
    refused_as_bad_request,
    response_id,
    sampling_params,
    sse,
    stop_hold_back,
    token_logprobs,
    truncated,
    usage,
)
from engine.entrypoints.openai.serving_tools import (
    ChatOutputParser,
    ChatParsers,
    ToolPlan,
    apply_tool_plan,
    finish_reason,
    plan_tools,
    whole_message,
)
from engine.entrypoints.openai.structured_fields import apply_reasoning_gate, constraint_field
from engine.errors import InvalidRequestError
from engine.input_processor import check_prompt_chars
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling.params import SamplingParams

#: a rough size of the chat template's own text around each message, in characters
_TEMPLATE_CHARS_PER_MESSAGE = 32


async def chat_prompt_ids(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    bounded: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it (``encode_conversation``:
    text typed in a message never becomes a special token, unless the server allows it).

    A large conversation is rendered and tokenized on the server's tokenizing threads.

    Args:
        ctx: the server.
        messages: the conversation.
        add_generation_prompt: end with the header of the assistant's turn.
        bounded: refuse, before any work, a conversation whose characters alone cannot fit the
            context (``/tokenize`` counts any conversation, so it passes False).
        tools: OpenAI function tools for the template (``engine.chat_tools``).
        template_kwargs: the request's ``chat_template_kwargs``.

    Raises:
        OpenAIError: 400 naming ``messages`` (or ``tools``, ``chat_template_kwargs``).
    """
    check_content_parts(messages)
    tokenizer = ctx.engine.tokenizer
    conversation = [m.to_template() for m in messages]
    # what the template renders besides message text counts too: tool definitions and earlier calls
    extras = [m["tool_calls"] for m in conversation if m.get("tool_calls")] + [v for v in (tools, template_kwargs) if v]
    num_chars = sum(len(m["content"] or "") for m in conversation) + sum(len(json.dumps(v)) for v in extras)
    max_model_len = ctx.engine.max_model_len if bounded else None
    if max_model_len is not None:
        with refused_as_bad_request():
            check_prompt_chars(num_chars, max_model_len, tokenizer.max_token_chars, "messages")
    # the template's own text grows with the number of messages
    size = num_chars + _TEMPLATE_CHARS_PER_MESSAGE * len(conversation)
    return await ctx.off_loop(
        size, _encode_chat, ctx, conversation, add_generation_prompt, max_model_len, tools, template_kwargs
    )


def _encode_chat(
    ctx: ServingContext,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    max_model_len: int | None,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    try:
        return encode_conversation(
            ctx.engine.tokenizer, conversation, add_generation_prompt, ctx.allow_special_tokens_in_messages,
            max_model_len, tools=tools, template_kwargs=template_kwargs,
        )  # fmt: skip
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    except ValueError as exc:  # the template rejected the conversation (e.g. roles out of order)
        raise bad_request(f"messages: {exc}", param="messages") from None


def _chat_logprobs(items: list[TokenLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": it.token,
                "logprob": it.logprob,
                "bytes": list(it.token.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in it.top],
            }
            for it in items
        ]
    }


class ChatHandler:
    """Serves chat completions for one server."""

    def __init__(self, ctx: ServingContext, parsers: ChatParsers | None = None) -> None:
        self.ctx = ctx
        self.parsers = parsers or ChatParsers()

    async def __call__(self, request: Request) -> JSONResponse | StreamingResponse:
        req = await parse_body(request, ChatCompletionRequest, self.ctx.max_body_bytes)
        call, stream = await self.start(request, req)
        if req.stream:
            return StreamingResponse(call.stream(request, stream), media_type="text/event-stream")
        return JSONResponse(await call.complete(request, stream))

    async def start(self, request: Request, req: ChatCompletionRequest) -> tuple[_ChatCall, RequestStream]:
        """Check a chat request and add it to the engine (other APIs, e.g. Anthropic's Messages, arrive
        here translated into one).

        Returns:
            The call, whose ``complete`` or ``stream`` gives the response, and the request's stream.

        Raises:
            OpenAIError: a field is invalid or refused (named in the error).
        """
        ctx = self.ctx
        ctx.check_model(req.model)
        check_extra_fields(req, "/v1/chat/completions", ctx.unknown_fields, UNSUPPORTED_CHAT_FIELDS)
        plan = plan_tools(req, self.parsers)
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", param="max_tokens")
        max_tokens = req.max_completion_tokens or req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        params = sampling_params(req, ctx, max_tokens, num_top if req.logprobs else None)
        params = apply_tool_plan(params, plan, self.parsers)
        constraint_param = constraint_field(req)
        params = apply_reasoning_gate(params, self.parsers.reasoning_parser, constraint_param)
        reasoning = self.parsers.reasoning_parser
        if reasoning is not None and reasoning.needs_special_tokens and isinstance(params, SamplingParams):
            params = params.model_copy(update={"skip_special_tokens": False})  # its markers are special tokens
        prompt_ids = await chat_prompt_ids(
            ctx, req.messages, req.add_generation_prompt, tools=plan.tools, template_kwargs=req.chat_template_kwargs
        )
        prompt_ids = truncated(prompt_ids, req.truncate_prompt_tokens)
        check_prompt(prompt_ids, max_tokens, ctx.engine.max_model_len, ctx.vocab_size, "max_completion_tokens")
        ctx.limits.check_total_tokens([len(prompt_ids)], req.n, max_tokens, ctx.engine.max_model_len, "max_completion_tokens")
        request_id = response_id("chatcmpl", req.request_id)
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if req.request_id else request_id
        stream = await add_request(ctx, engine_id, prompt_ids, params, req.cache_salt, constraint_param, req.priority, req.model)
        call = _ChatCall(ctx, req, request_id, prompt_ids, num_top, plan, self.parsers, engine_id)
        record_usage(request, len(prompt_ids), 0)
        return call, stream


def translated_chat_request(
    fields: dict[str, Any], optional: tuple[tuple[str, Any], ...], param: str
) -> ChatCompletionRequest:
    """The chat request another API's request translates into (Anthropic's Messages, OpenAI's
    Responses): ``fields`` plus each optional field that was given.

    Args:
        fields: the chat request's fields.
        optional: (chat field, value) pairs, set only where the value is not None.
        param: the other API's field to blame when the translation is not a valid chat request.

    Raises:
        OpenAIError: 400 naming ``param``.
    """
    fields = {**fields, **{name: value for name, value in optional if value is not None}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise bad_request(f"{param}: {exc.errors()[0]['msg']}", param=param) from None


class _ChatCall:
    """One chat request's response, whole or as server-sent events."""

    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str, prompt_ids: list[int], num_top: int,
        plan: ToolPlan, parsers: ChatParsers, engine_id: str,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.plan = plan
        self.parsers = parsers
        self.req = req
        #: the response's id, and the engine's id of the request (they differ when the caller named it)
        self.request_id = request_id
        self.engine_id = engine_id
        self.prompt_ids = prompt_ids
        self.num_prompt = len(prompt_ids)
        self.num_top = num_top
        self.created = int(time.time())
        #: the ``model`` the response reports: the adapter's name under a LoRA adapter
        self.model = ctx.reported_model(req.model)

    def _decode(self, token_id: int) -> str:
        return self.ctx.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def complete(self, request: Request, stream: RequestStream) -> dict[str, Any]:
        final: RequestOutput | None = None
        async with abort_on_disconnect(request, self.ctx.engine, [self.engine_id]):
            try:
                async for output in stream:
                    final = output
            except EngineDeadError as exc:
                raise OpenAIError(503, str(exc), code="engine_unavailable") from None
        outputs = final.outputs if final is not None else []
        choices = []
        for out in sorted(outputs, key=lambda o: o.index):
            logprobs = None
            if self.req.logprobs:
                logprobs = _chat_logprobs(token_logprobs(out, 0, len(out.token_ids), self.num_top, self._decode))
            parser = ChatOutputParser(self.plan, self.parsers)
            choices.append(
                {
                    "index": out.index,
                    "message": whole_message(parser, out.text),
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(parser, out.finish_reason) or ("abort" if stream.aborted else None),
                    # the stop string or token id that ended it (None for EOS or the length limit)
                    "stop_reason": out.stop_reason,
                    **({"token_ids": list(out.token_ids)} if self.req.return_token_ids else {}),
                }
            )
        record_usage(request, self.num_prompt, sum(len(o.token_ids) for o in outputs))
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.num_prompt, sum(len(o.token_ids) for o in outputs), final.num_cached_tokens if final else 0),
            **({"prompt_token_ids": self.prompt_ids} if self.req.return_token_ids else {}),
        }

    def _chunk(self, choices: list[dict[str, Any]], with_usage_field: bool, usage_value: Any = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage_field:
            chunk["usage"] = usage_value
        return chunk

    async def stream(self, request: Request, stream: RequestStream) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        hold = stop_hold_back(self.req.stop)
        trackers = [DeltaTracker(hold_back=hold) for _ in range(self.req.n)]
        parsers = [ChatOutputParser(self.plan, self.parsers) for _ in range(self.req.n)]
        finished = [False] * self.req.n
        completion_tokens = [0] * self.req.n
        async with abort_on_disconnect(request, self.ctx.engine, [self.engine_id]):
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.req.n)
            ]
            yield sse(self._chunk(first, include_usage))
            try:
                async for output in stream:
                    for out in output.outputs:
                        if out.index >= self.req.n or finished[out.index]:
                            continue
                        completion_tokens[out.index] = len(out.token_ids)
                        record_usage(request, self.num_prompt, sum(completion_tokens))
                        chunk_choices = self._delta_choices(out, trackers[out.index], parsers[out.index])
                        if out.finished:
                            finished[out.index] = True
                        for choice in chunk_choices:
                            yield sse(self._chunk([choice], include_usage))
            except EngineDeadError as exc:
                yield sse(OpenAIError(503, str(exc), code="engine_unavailable").body())
                yield sse("[DONE]")
                return
            for i in range(self.req.n):
                if not finished[i]:  # aborted (server shutting down)
                    done = {"index": i, "delta": {}, "logprobs": None, "finish_reason": "abort"}
                    yield sse(self._chunk([done], include_usage))
            if include_usage:
                yield sse(self._chunk([], True, usage(self.num_prompt, sum(completion_tokens))))
            yield sse("[DONE]")

    def _delta_choices(self, out: CompletionOutput, tracker: DeltaTracker, parser: ChatOutputParser) -> list[dict[str, Any]]:
        text = tracker.next_text(out)
        start, end = tracker.next_tokens(out)
        logprobs = None
        if self.req.logprobs and end > start:
            logprobs = _chat_logprobs(token_logprobs(out, start, end, self.num_top, self._decode))
        # the parsers hold back text that may still be a marker or a call; what they release goes out
        delta = parser.feed(text) if text else {}
        if out.finished:
            delta = _joined(delta, parser.finish())
        choices = []
        if delta or logprobs is not None:
            choices.append({"index": out.index, "delta": delta or {"content": ""}, "logprobs": logprobs, "finish_reason": None})
        if out.finished:
            reason = finish_reason(parser, out.finish_reason)
            choices.append({"index": out.index, "delta": {}, "logprobs": None, "finish_reason": reason, "stop_reason": out.stop_reason})
        return choices


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two deltas of one step as one (texts concatenated, call pieces listed in order)."""
    out = dict(first)
    for key, value in second.items():
        out[key] = out[key] + value if key in out else value
    return out
