"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Unknown fields are refused (400 naming them), as are content the engine cannot take (images, documents);
``cache_control`` on a block is accepted: prefix caching is automatic here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    """An earlier assistant turn's tool call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    # what the client's own model of a returned block carries: only their empty values are meaningful here
    caller: None = None
    toolset_name: None = None


class ToolResultBlock(_Strict):
    """The caller's answer to a tool call (in a user turn)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    """An earlier assistant turn's reasoning (passed to templates that render it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Strict):
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(_Strict):
    """``POST /v1/messages``."""

    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # ``user_id`` identifies the end user to Anthropic; it changes nothing in what is generated
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``."""

    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
