"""Tools and reasoning in chat responses: what a request's ``tools``/``tool_choice`` allow, the grammar
that forces a call, and the split of the output into ``reasoning_content``, ``content`` and
``tool_calls``, whole or streamed.

One :class:`ChatOutputParser` per choice does the split; a whole response is a stream fed its text in
one piece, so streamed and whole responses agree by construction. The reasoning parser runs first and
the tool parser reads only the answer after the thinking.

``tool_choice``:

* ``none``: the tools are rendered into the prompt but the output is plain text;
* ``auto`` (the default with tools): the configured ``--tool-call-parser`` reads calls out of the text;
  without ``--enable-auto-tool-choice`` such a request is refused, as the leading engine does;
* ``required`` / a named function: a JSON-schema grammar (:func:`tool_call_constraint`) makes the output
  a call whose arguments validate against the tool's parameters; it is then read as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.beam_search import BeamSearchParams
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_tools import NamedToolChoice, check_tools
from engine.entrypoints.openai.serving_common import refused_as_bad_request
from engine.reasoning import ReasoningParser, ReasoningStream
from engine.sampling.params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.tool_parsers import ToolCallStream, ToolParser, openai_call_id

ToolMode = Literal["none", "auto", "required", "named"]
#: the parameters schema of a tool that declares none: any object
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers, from ``engine serve``'s options.

    Attributes:
        tool_parser: ``--tool-call-parser``'s parser, or None.
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: parse calls out of ``auto`` requests' text.
        reasoning_parser: ``--reasoning-parser``'s parser, or None.
    """

    tool_parser: ToolParser | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: ReasoningParser | None = None

    def new_call_id(self) -> str:
        """An id for a call the server builds itself, in the configured family's format."""
        return self.tool_parser.new_call_id() if self.tool_parser is not None else openai_call_id()


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools ask of the response.

    Attributes:
        mode: how calls are made: ``none`` (no tools, or ``tool_choice: none``), ``auto``, ``required``
            or ``named``.
        tools: the tools as OpenAI JSON, for the prompt; None when the request has none.
        function: the function a ``named`` choice forces.
        parallel: ``parallel_tool_calls``: more than one call per response is allowed.
    """

    mode: ToolMode
    tools: list[dict[str, Any]] | None = None
    function: str | None = None
    parallel: bool = True


def plan_tools(req: ChatCompletionRequest, parsers: ChatParsers) -> ToolPlan:
    """Check a request's tool fields against each other and the server's options.

    Raises:
        OpenAIError: 400 naming ``tools`` or ``tool_choice``.
    """
    with refused_as_bad_request():
        check_tools(req.tools, req.tool_choice)
    if not req.tools:
        return ToolPlan("none")
    tools = [tool.to_dict() for tool in req.tools]
    choice = req.tool_choice or "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not (parsers.enable_auto_tool_choice and parsers.tool_parser is not None):
            raise bad_request(
                'tool_choice "auto" (the default when tools are given) needs a server started with '
                '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "none", "required" '
                "or a named function instead",
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parallel=req.parallel_tool_calls)
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tools, function=choice.function.name, parallel=req.parallel_tool_calls)
    return ToolPlan("required", tools, parallel=req.parallel_tool_calls)


def tool_call_constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The grammar that makes a ``required`` or ``named`` response a valid call, else None.

    ``named``: the output is the function's arguments, valid against its parameters schema.
    ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects, at least one (exactly
    one without ``parallel_tool_calls``), each matching one tool's name and parameters schema. The
    tools' ``$defs`` move to the top, where their ``#/$defs/...`` references then resolve.
    """
    if plan.mode == "named":
        tool = next(t for t in plan.tools or [] if t["function"]["name"] == plan.function)
        return StructuredOutputsParams(json=tool["function"].get("parameters") or _ANY_OBJECT)
    if plan.mode != "required":
        return None
    defs: dict[str, Any] = {}
    options = []
    for tool in plan.tools or []:
        parameters = dict(tool["function"].get("parameters") or _ANY_OBJECT)
        for key in ("$defs", "definitions"):
            defs.update(parameters.pop(key, None) or {})
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema)


def apply_tool_plan(
    params: SamplingParams | BeamSearchParams, plan: ToolPlan, parsers: ChatParsers
) -> SamplingParams | BeamSearchParams:
    """The sampling settings with what the plan needs: the call grammar, and the special tokens a
    tool parser must see (``ToolParser.adjust_skip_special_tokens``).

    Raises:
        OpenAIError: 400 naming ``tool_choice`` when a forced call meets beam search or another
            output constraint.
    """
    constraint = tool_call_constraint(plan)
    if constraint is not None:
        if isinstance(params, BeamSearchParams):
            raise bad_request(
                f'tool_choice "{plan.mode}" needs sampling; it cannot be used with use_beam_search',
                param="tool_choice",
            )
        if params.structured_outputs is not None:
            raise bad_request(
                f'tool_choice "{plan.mode}" constrains the output itself; drop the other output constraint',
                param="tool_choice",
            )
        return params.model_copy(update={"structured_outputs": constraint})
    if plan.mode == "auto" and isinstance(params, SamplingParams) and parsers.tool_parser is not None:
        skip = parsers.tool_parser.adjust_skip_special_tokens(params.skip_special_tokens)
        return params.model_copy(update={"skip_special_tokens": skip})
    return params


class ChatOutputParser:
    """Splits one choice's output into the fields of OpenAI deltas, fed its text as it is generated.

    Args:
        plan: the request's tool plan.
        parsers: the server's parsers.
    """

    def __init__(self, plan: ToolPlan, parsers: ChatParsers) -> None:
        self._plan = plan
        self._new_call_id: Callable[[], str] = parsers.new_call_id
        # a forced call's grammar holds from the first token, leaving no room for thinking: the whole
        # output is the call (a reasoning parser would read it as unfinished thinking)
        forced = plan.mode in ("required", "named")
        self._reasoning: ReasoningStream | None = (
            parsers.reasoning_parser.start_stream() if parsers.reasoning_parser is not None and not forced else None
        )
        self._tools: ToolCallStream | None = None
        if plan.mode == "auto" and parsers.tool_parser is not None:
            self._tools = parsers.tool_parser.start_stream(plan.tools)
        self._constrained: list[str] = []  # the JSON of a required/named output
        self._named_id: str | None = None
        self.tools_called = False

    @property
    def active(self) -> bool:
        """Whether the output is parsed at all (else it is all content, as without tools)."""
        return self._reasoning is not None or self._plan.mode != "none"

    @property
    def reports_reasoning(self) -> bool:
        return self._reasoning is not None

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields that ``text``, the next piece of the output, makes certain (maybe none)."""
        if self._reasoning is None:
            return self._answer(text, final=False)
        delta = self._reasoning.feed(text)
        out: dict[str, Any] = {}
        if delta is not None:
            if delta.reasoning_content:
                out["reasoning_content"] = delta.reasoning_content
            out |= self._answer(delta.content or "", final=False)
        return out

    def finish(self) -> dict[str, Any]:
        """The delta fields held back until the output ended."""
        out: dict[str, Any] = {}
        content = ""
        if self._reasoning is not None:
            delta = self._reasoning.finish()
            if delta is not None:
                if delta.reasoning_content:
                    out["reasoning_content"] = delta.reasoning_content
                content = delta.content or ""
        answer = self._answer(content, final=False)
        tail = self._answer("", final=True)
        return out | merge_answer_deltas([answer, tail])

    def _answer(self, text: str, final: bool) -> dict[str, Any]:
        mode = self._plan.mode
        if mode == "auto" and self._tools is not None:
            delta = self._tools.finish() if final else self._tools.feed(text) if text else None
            if delta is None:
                return {}
            out = delta.to_dict()
            if "tool_calls" in out:
                if not self._plan.parallel:  # only the first call of the response stands
                    out["tool_calls"] = [c for c in out["tool_calls"] if c["index"] == 0]
                    if not out["tool_calls"]:
                        del out["tool_calls"]
                self.tools_called = self.tools_called or "tool_calls" in out
            return out
        if mode == "named":
            if not text:
                return {}
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self._named_id is None:
                self._named_id = self._new_call_id()
                call = {"index": 0, "id": self._named_id, "type": "function",
                        "function": {"name": self._plan.function, "arguments": text}}  # fmt: skip
                self.tools_called = True
            return {"tool_calls": [call]}
        if mode == "required":
            self._constrained.append(text)
            return self._required_calls() if final else {}
        return {"content": text} if text else {}

    def _required_calls(self) -> dict[str, Any]:
        """The calls of a finished ``required`` output; its text as content if it did not finish as JSON
        (cut by ``max_tokens``)."""
        text = "".join(self._constrained)
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
        ):
            return {"content": text} if text else {}
        calls = [
            {"index": i, "id": self._new_call_id(), "type": "function",
             "function": {"name": item["name"], "arguments": json.dumps(item.get("parameters", {}), ensure_ascii=False)}}
            for i, item in enumerate(items)
        ]  # fmt: skip
        self.tools_called = bool(calls)
        return {"tool_calls": calls} if calls else {}


def merge_answer_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas joined into one: texts concatenated, call pieces of one index joined into one call."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for key in ("reasoning_content", "content"):
            if delta.get(key):
                out[key] = out.get(key, "") + delta[key]
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"index": piece["index"], "function": {}})
            for key in ("id", "type"):
                if key in piece:
                    call[key] = piece[key]
            function = call["function"]
            for key, value in piece["function"].items():
                function[key] = function.get(key, "") + value if key == "arguments" else value
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def whole_message(parser: ChatOutputParser, text: str) -> dict[str, Any]:
    """The ``message`` of a whole response: the output fed in one piece, then finished."""
    if not parser.active:
        return {"role": "assistant", "content": text}
    merged = merge_answer_deltas([parser.feed(text), parser.finish()])
    calls = [{k: v for k, v in call.items() if k != "index"} for call in merged.get("tool_calls", [])]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": merged.get("content") or (None if calls else ""),
    }
    if parser.reports_reasoning:
        message["reasoning_content"] = merged.get("reasoning_content")
    if calls:
        message["tool_calls"] = calls
    return message


def finish_reason(parser: ChatOutputParser, reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` for an output that ended by itself after making calls."""
    return "tool_calls" if reason == "stop" and parser.tools_called else reason
