"""Request body of OpenAI's Responses API (``POST /v1/responses``), stateless.

Unknown fields are refused (400 naming them); ``store: true`` and ``previous_response_id`` are refused by
the handler (nothing is stored, so nothing can be continued).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    """An earlier turn's function call (as a response's output lists it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The caller's answer to a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or a JSON schema (structured output)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # stateless: the handler refuses ``store: true`` and a ``previous_response_id`` with a reason
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
