"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, served by the chat
pipeline: a request is translated into a chat completion request (system prompt, turns, tool calls and
results, tools and tool choice), and the chat answer, whole or streamed, back into Anthropic's message and
event shapes. Errors take Anthropic's shape too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_anthropic import (
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
)
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_chat import ChatHandler, chat_prompt_ids, translated_chat_request
from engine.entrypoints.openai.serving_tools import plan_tools

#: HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error",
}  # fmt: skip
#: the chat API's finish reasons -> Anthropic's stop reasons
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn", "abort": "end_turn"}


def anthropic_error(err: OpenAIError) -> JSONResponse:
    """An error in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``)."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": err.message}}, status_code=err.status, headers=err.headers)


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text for block in content)


def _chat_messages(system: str | list[TextBlock] | None, turns: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: tool calls onto the assistant message, each tool result a
    ``tool`` message, in order."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": _text(system)})
    for turn in turns:
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in turn.content:
            if block.type == "text":
                text.append(block.text)
            elif block.type == "thinking":
                reasoning.append(block.thinking)
            elif block.type == "tool_use":
                if turn.role != "assistant":
                    raise bad_request("tool_use blocks belong to assistant turns", param="messages")
                calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            else:
                if turn.role != "user":
                    raise bad_request("tool_result blocks belong to user turns", param="messages")
                if text:  # text before a result stays before it
                    messages.append({"role": "user", "content": "".join(text)})
                    text = []
                content = _text(block.content)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {content}" if block.is_error else content})
        if turn.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            messages.append(message)
        elif text:
            messages.append({"role": "user", "content": "".join(text)})
    return messages


def _tools(tools: list[AnthropicTool] | None, choice: AnthropicToolChoice | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in tools
        ]
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    if thinking is not None and thinking.get("type") != "disabled":
        raise bad_request("thinking is not supported (a reasoning model's thoughts come back as thinking blocks when the server runs a reasoning parser)", param="thinking")


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves a Messages request.

    Raises:
        OpenAIError: a field the engine cannot honour (named).
    """
    _check_thinking(req.thinking)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": _chat_messages(req.system, req.messages),
        "max_completion_tokens": req.max_tokens,
        "stream": req.stream,
        **_tools(req.tools, req.tool_choice),
    }
    if req.stream:
        fields["stream_options"] = {"include_usage": True}  # message_delta reports the output tokens
    optional = (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k), ("stop", req.stop_sequences))
    return translated_chat_request(fields, optional, "messages")


def _stop_reason(choice: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    stop = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(stop, str) and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return _STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def anthropic_message(chat: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """A chat completion as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_reason, stop_sequence = _stop_reason(choice, req.stop_sequences)
    return {
        "id": f"msg_{chat['id'].removeprefix('chatcmpl-')}", "type": "message", "role": "assistant",
        "model": chat["model"], "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": chat["usage"]["completion_tokens"]},
    }  # fmt: skip


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def anthropic_events(chunks: AsyncIterator[str], req: MessagesRequest, message_id: str, model: str, input_tokens: int) -> AsyncIterator[str]:
    """The chat stream's server-sent chunks as Anthropic's event sequence: ``message_start``, then per
    content block ``content_block_start`` / ``_delta`` / ``_stop``, then ``message_delta`` (stop reason,
    output tokens) and ``message_stop``."""
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }})  # fmt: skip
    index, open_kind = -1, None
    stop: tuple[str, str | None] = ("end_turn", None)

    def start(block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind is not None else []
        index, open_kind = index + 1, block["type"]
        return [*out, _event("content_block_start", {"index": index, "content_block": block})]

    async for raw in chunks:
        data = raw.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            yield _event("error", {"error": {"type": "api_error", "message": chunk["error"].get("message", "")}})
            return
        if chunk.get("usage") and not chunk.get("choices"):
            if open_kind is not None:
                yield _event("content_block_stop", {"index": index})
                open_kind = None
            yield _event("message_delta", {
                "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                "usage": {"output_tokens": chunk["usage"]["completion_tokens"]},
            })  # fmt: skip
            continue
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if open_kind != "thinking":
                    for event in start({"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                if open_kind != "text":
                    for event in start({"type": "text", "text": ""}):
                        yield event
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    for event in start({"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}):
                        yield event
                if function.get("arguments"):
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                stop = _stop_reason(choice, req.stop_sequences)
    yield _event("message_stop", {})


class MessagesHandler:
    """Serves Anthropic's Messages API through the server's chat handler."""

    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    async def messages(self, request: Request) -> JSONResponse | StreamingResponse:
        try:
            req = await parse_body(request, MessagesRequest, self.chat.ctx.max_body_bytes)
            call, stream = await self.chat.start(request, chat_request(req))
            if req.stream:
                message_id = f"msg_{call.request_id.removeprefix('chatcmpl-')}"
                events = anthropic_events(call.stream(request, stream), req, message_id, call.model, call.num_prompt)
                return StreamingResponse(events, media_type="text/event-stream")
            return JSONResponse(anthropic_message(await call.complete(request, stream), req))
        except OpenAIError as err:
            return anthropic_error(err)

    async def count_tokens(self, request: Request) -> JSONResponse:
        try:
            ctx = self.chat.ctx
            req = await parse_body(request, CountTokensRequest, ctx.max_body_bytes)
            ctx.check_model(req.model)
            _check_thinking(req.thinking)
            fields = {"model": req.model, "messages": _chat_messages(req.system, req.messages), **_tools(req.tools, req.tool_choice)}
            chat = translated_chat_request(fields, (), "messages")
            plan = plan_tools(chat, self.chat.parsers)
            ids = await chat_prompt_ids(ctx, chat.messages, True, tools=plan.tools)
            return JSONResponse({"input_tokens": len(ids)})
        except OpenAIError as err:
            return anthropic_error(err)

