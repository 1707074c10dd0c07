"""POST /v1/responses (OpenAI's Responses API, stateless), served by the chat pipeline: input items
become chat messages (instructions first, function calls onto assistant turns, their outputs ``tool``
messages), ``text.format`` a response format, and the chat answer, whole or streamed, a response object
or its event sequence."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_responses import ResponsesRequest, TextFormat
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.serving_chat import ChatHandler, translated_chat_request


def _chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if item.type == "message":
            content = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            messages.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves a Responses request.

    Raises:
        OpenAIError: a field the engine cannot honour (named).
    """
    if req.store:
        raise bad_request("store is not supported: this server keeps no responses (send store: false)", param="store")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server keeps no responses; send the whole conversation as input", param="previous_response_id")
    fields: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req), "stream": req.stream}
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    if req.tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = _response_format(req.text.format if req.text else None)
    if response_format is not None:
        fields["response_format"] = response_format
    optional = (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature), ("top_p", req.top_p), ("user", req.user))
    return translated_chat_request(fields, optional, "input")


class _Response:
    """Builds one response object and its events."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.sequence = 0

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None, incomplete: bool = False) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "metadata": req.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else req.tool_choice.model_dump(),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "store": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}},
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
            },
        }  # fmt: skip

    def event(self, kind: str, payload: dict[str, Any]) -> str:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence - 1, **payload}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def response_object(chat: dict[str, Any], builder: _Response) -> dict[str, Any]:
    """A chat completion as a response object."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(f"msg_{chat['id'].removeprefix('chatcmpl-')}", message["content"]))
    output.extend(_call_item(call) for call in message.get("tool_calls") or [])
    incomplete = choice.get("finish_reason") == "length"
    return builder.body("incomplete" if incomplete else "completed", output, chat["usage"], incomplete)


async def response_events(chunks: AsyncIterator[str], builder: _Response) -> AsyncIterator[str]:
    """The chat stream's chunks as the Responses event sequence."""
    yield builder.event("response.created", {"response": builder.body("in_progress", [], None)})
    yield builder.event("response.in_progress", {"response": builder.body("in_progress", [], None)})
    output: list[dict[str, Any]] = []
    text, text_index, message_id = "", None, f"msg_{builder.id.removeprefix('resp_')}"
    calls: list[dict[str, Any]] = []
    finish = None
    usage = None

    def close_text() -> list[str]:
        nonlocal text_index
        if text_index is None:
            return []
        part = {"type": "output_text", "text": text, "annotations": []}
        item = _message_item(message_id, text)
        output[text_index] = item
        events = [
            builder.event("response.output_text.done", {"item_id": message_id, "output_index": text_index, "content_index": 0, "text": text, "logprobs": []}),
            builder.event("response.content_part.done", {"item_id": message_id, "output_index": text_index, "content_index": 0, "part": part}),
            builder.event("response.output_item.done", {"output_index": text_index, "item": item}),
        ]
        text_index = None
        return events

    def close_call() -> list[str]:
        if not calls or calls[-1].get("done"):
            return []
        call = calls[-1]
        call["done"] = True
        item = _call_item(call)
        output[call["index"]] = item
        return [
            builder.event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": call["index"], "arguments": item["arguments"]}),
            builder.event("response.output_item.done", {"output_index": call["index"], "item": item}),
        ]

    async for raw in chunks:
        data = raw.removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            yield builder.event("error", {"code": chunk["error"].get("code"), "message": chunk["error"].get("message", ""), "param": None})
            return
        if chunk.get("usage") and not chunk.get("choices"):
            usage = chunk["usage"]
            continue
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if text_index is None:
                    for event in close_call():
                        yield event
                    text_index = len(output)
                    output.append(_message_item(message_id, "", "in_progress"))
                    yield builder.event("response.output_item.added", {"output_index": text_index, "item": output[text_index]})
                    yield builder.event("response.content_part.added", {"item_id": message_id, "output_index": text_index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
                text += delta["content"]
                yield builder.event("response.output_text.delta", {"item_id": message_id, "output_index": text_index, "content_index": 0, "delta": delta["content"], "logprobs": []})
            for piece in delta.get("tool_calls") or []:
                function = piece.get("function") or {}
                if piece.get("id"):
                    for event in [*close_text(), *close_call()]:
                        yield event
                    call = {"id": piece["id"], "index": len(output), "function": {"name": function.get("name", ""), "arguments": ""}}
                    calls.append(call)
                    output.append(_call_item(call, "in_progress"))
                    yield builder.event("response.output_item.added", {"output_index": call["index"], "item": output[call["index"]]})
                if function.get("arguments") and calls:
                    calls[-1]["function"]["arguments"] += function["arguments"]
                    yield builder.event("response.function_call_arguments.delta", {"item_id": f"fc_{calls[-1]['id']}", "output_index": calls[-1]["index"], "delta": function["arguments"]})
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    for event in [*close_text(), *close_call()]:
        yield event
    incomplete = finish == "length"
    final = builder.body("incomplete" if incomplete else "completed", output, usage, incomplete)
    yield builder.event("response.incomplete" if incomplete else "response.completed", {"response": final})


class ResponsesHandler:
    """Serves the Responses API through the server's chat handler."""

    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    async def __call__(self, request: Request) -> JSONResponse | StreamingResponse:
        req = await parse_body(request, ResponsesRequest, self.chat.ctx.max_body_bytes)
        call, stream = await self.chat.start(request, chat_request(req))
        builder = _Response(req, f"resp_{call.request_id.removeprefix('chatcmpl-')}", call.model)
        if req.stream:
            return StreamingResponse(response_events(call.stream(request, stream), builder), media_type="text/event-stream")
        return JSONResponse(response_object(await call.complete(request, stream), builder))
