"""The tool-call parser interface: one model family's way of writing calls, as an output split into
text and call blocks.

A parser only says where a call block starts and how far one goes (``find_call_start`` and
``scan_call_block``); :class:`~engine.tool_parsers.stream.ToolCallStream` does the rest, for a stream
and for a finished output alike (a finished output is a stream fed all at once), so streaming and
non-streaming results agree by construction, whatever the delta boundaries.

The malformed-output rule: parsing never raises on what a model wrote. A call block that does not
parse (truncated JSON, an unknown function name, arguments that are not an object, Python that is not
a list of calls with literal keyword arguments) is returned verbatim as content, and only well-formed
blocks become calls; an output whose every block is malformed is returned exactly as plain content.
Because the verdict on a block needs the whole block, a stream holds a block back until it is
complete and then sends the call whole (its name and all its arguments in one delta): a client never
receives part of a call the finished output would not contain.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.tool_parsers.stream import ToolCallStream
from engine.tool_parsers.types import ExtractedToolCalls

#: the request's ``tools``: OpenAI tool dicts, pydantic tool models, or function names; None for "any name"
ToolsArg = Iterable[Any] | None

_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def function_names(tools: ToolsArg) -> frozenset[str] | None:
    """The function names a request offers, which a call must use to count as one.

    Args:
        tools: OpenAI tool dicts (``{"type": "function", "function": {"name": ...}}``), objects with
            ``.function.name`` (pydantic models), plain names, or None.

    Returns:
        The names, or None when ``tools`` is None, meaning no check on names.
    """
    if tools is None:
        return None
    names: set[str] = set()
    for tool in tools:
        if isinstance(tool, str):
            names.add(tool)
            continue
        function = tool.get("function") if isinstance(tool, Mapping) else getattr(tool, "function", None)
        name = function.get("name") if isinstance(function, Mapping) else getattr(function, "name", None)
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


@dataclass(frozen=True)
class ParsedCall:
    """One call read from a block.

    Attributes:
        name: the function's name.
        arguments: the arguments as the JSON text of an object.
        id: the id the model itself wrote for the call (Mistral's ``[CALL_ID]``), else None for a fresh one.
    """

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class CallBlock:
    """The verdict on a complete call block.

    Attributes:
        end: the index just past the block in the output.
        calls: the calls it holds, or None when it is malformed (it is then returned as content).
    """

    end: int
    calls: list[ParsedCall] | None


class ToolParser(ABC):
    """How one model family writes tool calls. Stateless, so one instance serves every request; a
    stream's state lives in the :class:`ToolCallStream` that :meth:`start_stream` returns.

    Subclasses set the class attributes and implement :meth:`scan_call_block`. A plugin file registers
    a subclass with ``registry.register(name, cls)`` (see ``ToolParserRegistry.load_plugin_file``).

    Args:
        tokenizer: the model's tokenizer; the built-in parsers work on text and do not use it.
        id_generator: makes the id of each call; defaults to :meth:`default_call_id` (tests pass a
            deterministic one).
    """

    #: text that starts a call block wherever it appears; the server may hold back text that could
    #: be the start of one (the stream already does)
    tool_call_start_markers: ClassVar[tuple[str, ...]] = ()
    #: characters that start a call block only as the first non-whitespace character of the output
    #: (Llama's bare ``{``, the pythonic ``[``)
    leading_call_chars: ClassVar[str] = ""
    #: the markers are special tokens: the server must detokenize with ``skip_special_tokens=False``
    #: for this parser to see them
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, *, id_generator: Callable[[], str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._id_generator = id_generator or self.default_call_id

    def default_call_id(self) -> str:
        """A fresh call id in this family's format (``call_`` and 24 alphanumerics unless overridden)."""
        return openai_call_id()

    def new_call_id(self) -> str:
        """The id for the next call, from the ``id_generator`` given, else :meth:`default_call_id`."""
        return self._id_generator()

    def adjust_skip_special_tokens(self, skip_special_tokens: bool) -> bool:
        """The ``skip_special_tokens`` setting a request with tools must be detokenized with.

        Args:
            skip_special_tokens: what the request asked for.

        Returns:
            False when this parser's markers are special tokens, else the request's own setting.
        """
        return False if self.needs_special_tokens else skip_special_tokens

    def extract_tool_calls(self, model_output: str, tools: ToolsArg = None) -> ExtractedToolCalls:
        """Split a finished output into text and tool calls. Never raises on what the model wrote.

        Args:
            model_output: the whole generated text.
            tools: the request's tools; a call naming a function not among them is malformed. None
                accepts any name.

        Returns:
            The text outside the calls (whitespace touching a call dropped at the start and end of
            it; None if nothing is left) and the calls in order, each with a fresh id; exactly
            ``model_output`` as content when there are no well-formed calls.
        """
        stream = self.start_stream(tools)
        stream.feed(model_output)
        stream.finish()
        return ExtractedToolCalls(content=stream.content or None, tool_calls=stream.tool_calls)

    def start_stream(self, tools: ToolsArg = None) -> ToolCallStream:
        """State for parsing one streamed output, fed its deltas in order.

        Args:
            tools: as for :meth:`extract_tool_calls`.

        Returns:
            A stream whose ``feed(delta_text)`` and, at the end, ``finish()`` return OpenAI-shaped deltas.
        """
        return ToolCallStream(self, function_names(tools))

    def find_call_start(self, text: str, pos: int, at_output_start: bool, final: bool) -> tuple[int | None, int]:
        """Where the next call block starts at or after ``pos``, and how much text before it is surely
        content.

        Args:
            text: the output so far.
            pos: where to look from; ``text[pos:]`` is outside any block.
            at_output_start: nothing but whitespace precedes ``pos`` in the output.
            final: the output is complete.

        Returns:
            ``(start, safe)``: the block's start (None if none is seen) and the index before which the
            text is content for certain. Unless ``final``, text that may still turn into a marker (a
            marker's first characters at the very end) is held back.
        """
        if at_output_start and self.leading_call_chars:
            first = pos
            while first < len(text) and text[first].isspace():
                first += 1
            if first == len(text) and not final:
                return None, pos
            if first < len(text) and text[first] in self.leading_call_chars:
                return first, first
        found = [i for i in (text.find(m, pos) for m in self.tool_call_start_markers) if i >= 0]
        if found:
            start = min(found)
            return start, start
        if final:
            return None, len(text)
        held = 0
        for marker in self.tool_call_start_markers:
            for k in range(min(len(marker) - 1, len(text) - pos), held, -1):
                if text.endswith(marker[:k]):
                    held = k
                    break
        return None, len(text) - held

    @abstractmethod
    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        """Read the call block that starts at ``start``.

        Args:
            text: the output so far.
            start: where :meth:`find_call_start` said a block starts.
            final: the output is complete; a block must then be decided.
            names: the function names a call may use; None for any.
            memo: a dict the stream keeps for this block between calls, empty at the first; a parser
                may save its progress there so a long block is not re-read from its start each
                delta (the built-ins other than ``pythonic`` leave it alone).

        Returns:
            The block's end and calls (None calls when malformed), or None when more text is needed
            to decide (never when ``final``). A decided block must end past ``start``.
        """
