"""The tool parts of a chat request: function tool definitions, ``tool_choice``, and the tool calls an
assistant message carries, validated so that a bad definition is a 400 naming its field."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from engine.errors import InvalidRequestError

#: OpenAI's rule for a function's name
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _ToolModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class FunctionDefinition(_ToolModel):
    """``tools[i].function``: a function the model may call, its arguments described by a JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _FUNCTION_NAME.fullmatch(v):
            raise ValueError(f"a function name is 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got {v[:80]!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return None
        kind = v.get("type")
        if kind is not None and kind != "object":
            raise ValueError(
                f"a function's parameters must be a JSON schema of type 'object', got type {kind!r}"
            )
        try:
            from jsonschema import SchemaError, validators
        except ImportError:  # the check is a courtesy; the grammar compiler refuses broken schemas too
            return v
        try:
            validators.validator_for(v).check_schema(v)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        return v


class ChatTool(_ToolModel):
    """One entry of ``tools``; OpenAI's chat API defines function tools only."""

    type: Literal["function"]
    function: FunctionDefinition

    def to_dict(self) -> dict[str, Any]:
        """The tool as OpenAI's JSON, unset fields left out (what templates and the tool prompt see)."""
        return self.model_dump(exclude_none=True)


class NamedFunction(_ToolModel):
    name: str


class NamedToolChoice(_ToolModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


#: ``tool_choice``'s forms
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class MessageFunctionCall(_ToolModel):
    name: str
    arguments: str


class MessageToolCall(_ToolModel):
    """One call in an assistant message's ``tool_calls`` (an earlier turn of the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """Cross-field checks pydantic cannot make per field.

    Raises:
        InvalidRequestError: two tools share a name (``tools``), or ``tool_choice`` names no tool or
            needs tools and none are given (``tool_choice``).
    """
    names = [t.function.name for t in tools or []]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequestError(
            f"tools: function names must be unique; repeated: {', '.join(duplicates)}", "tools"
        )
    if tool_choice is None or tool_choice == "none":
        return
    if not names:
        raise InvalidRequestError("tool_choice: only allowed when tools are given", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        name = tool_choice.function.name
        raise InvalidRequestError(
            f"tool_choice: names the function {name!r}, which is not among the tools", "tool_choice"
        )
