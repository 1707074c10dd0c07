"""What tool-call parsers return: whole calls for a finished output, OpenAI-shaped deltas for a stream.

Each type has ``to_dict()`` giving exactly the JSON OpenAI sends (``message.tool_calls[i]`` and
``choices[0].delta``), so the server never rebuilds the shape itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    """The function a call names and its arguments, as the JSON text of an object."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a finished output (``message.tool_calls[i]``)."""

    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A finished output split into text and tool calls.

    Attributes:
        content: the text outside the calls, None when there is none.
        tool_calls: the calls in the order the model wrote them; empty when it made none.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(frozen=True)
class DeltaFunctionCall:
    """A piece of a streamed call's function: ``name`` in the call's first delta only, and
    ``arguments`` fragments whose concatenation over the stream is the call's arguments JSON."""

    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class DeltaToolCall:
    """A piece of one streamed call; ``id`` and ``type`` come in the call's first delta only."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        function: dict[str, str] = {}
        if self.function.name is not None:
            function["name"] = self.function.name
        if self.function.arguments is not None:
            function["arguments"] = self.function.arguments
        out["function"] = function
        return out


@dataclass(frozen=True)
class DeltaMessage:
    """What one step of a stream adds: new text, new pieces of calls, or both.

    Attributes:
        content: text to send as ``delta.content``; None when there is none this step.
        tool_calls: call pieces to send as ``delta.tool_calls``; empty when there are none.
    """

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out
