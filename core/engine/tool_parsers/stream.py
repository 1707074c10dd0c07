"""One output's walk through text and call blocks, fed in deltas: the state a streamed request keeps.

The same walk serves finished outputs (fed whole, then finished), which is what makes streamed and
non-streamed results identical: content text is released as soon as it cannot be the start of a call
block, and a block is held until the parser decides it, then sent as a whole call or, if malformed,
as content.

Whitespace touching a well-formed call is dropped at the start and end of the content and kept
between two pieces of content, so ``"Let me check.\n<tool_call>...</tool_call>"`` has the content
``"Let me check."`` while text on both sides of a call keeps its line break. A stream therefore holds
whitespace back until it sees what follows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.tool_parsers.types import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall

if TYPE_CHECKING:
    from engine.tool_parsers.base import ToolParser


class ToolCallStream:
    """Parses one output incrementally; made by ``ToolParser.start_stream``.

    Args:
        parser: the family's parser.
        names: the function names a call may use; None for any.
    """

    def __init__(self, parser: ToolParser, names: frozenset[str] | None) -> None:
        self._parser = parser
        self._names = names
        self._text = ""
        self._pos = 0  # text before this index has been decided
        self._in_block = False  # a block starts at _pos and is not decided yet
        self._block_memo: dict[str, Any] = {}  # the parser's progress through the open block
        self._at_output_start = True  # only whitespace has been seen outside blocks
        self._pending_ws = ""  # content whitespace held until we know what follows it
        self._pending_touches_call = False  # a well-formed call sits inside or at the end of _pending_ws
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    @property
    def text(self) -> str:
        """The output fed so far."""
        return self._text

    @property
    def content(self) -> str:
        """All content released so far (the concatenation of the deltas' ``content``)."""
        return "".join(self._content)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls released so far, in order."""
        return list(self._calls)

    @property
    def finished(self) -> bool:
        return self._finished

    def feed(self, delta_text: str) -> DeltaMessage | None:
        """Take the next piece of the output.

        Args:
            delta_text: the text generated since the last call (may be empty).

        Returns:
            What became certain: content text and/or whole calls; None when nothing did yet.

        Raises:
            RuntimeError: the stream was already finished.
        """
        if self._finished:
            raise RuntimeError("feed() after finish(): a ToolCallStream parses one output")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaMessage | None:
        """End the output: decide any block still open and release the text held back.

        Returns:
            What was still held, or None when nothing was. A second call returns None.
        """
        if self._finished:
            return None
        delta = self._advance(final=True)
        self._finished = True
        return delta

    def _advance(self, final: bool) -> DeltaMessage | None:
        content_start, calls_start = len(self._content), len(self._calls)
        text = self._text
        while True:
            if not self._in_block:
                start, safe = self._parser.find_call_start(text, self._pos, self._at_output_start, final)
                self._emit_content(text[self._pos : safe])
                self._pos = safe
                if start is None:
                    break
                self._in_block = True
                self._block_memo = {}
                self._at_output_start = False
            block = self._parser.scan_call_block(text, self._pos, final, self._names, self._block_memo)
            if block is None:
                if final:
                    raise AssertionError(f"{type(self._parser).__name__}.scan_call_block left a finished output undecided")
                break
            if block.end <= self._pos:
                raise AssertionError(f"{type(self._parser).__name__}.scan_call_block returned an empty block")
            if block.calls is None:
                self._emit_content(text[self._pos : block.end])
            else:
                self._pending_touches_call = True
                for call in block.calls:
                    call_id = call.id or self._parser.new_call_id()
                    self._calls.append(ToolCall(id=call_id, function=FunctionCall(call.name, call.arguments)))
            self._pos = block.end
            self._in_block = False
        if final and self._pending_ws:
            # trailing whitespace is content unless a call ends the output
            if not self._pending_touches_call:
                self._content.append(self._pending_ws)
            self._pending_ws = ""
        return self._delta(content_start, calls_start)

    def _emit_content(self, piece: str) -> None:
        if not piece:
            return
        held = self._pending_ws + piece
        kept = held.rstrip()
        self._pending_ws = held[len(kept) :]
        if not kept:
            return
        if self._pending_touches_call and not self._content:
            # only calls came before this text: the whitespace around them starts no content
            kept = kept.lstrip()
        self._pending_touches_call = False
        self._at_output_start = False
        self._content.append(kept)

    def _delta(self, content_start: int, calls_start: int) -> DeltaMessage | None:
        content = "".join(self._content[content_start:])
        new_calls = self._calls[calls_start:]
        if not content and not new_calls:
            return None
        tool_calls = [
            DeltaToolCall(
                index=calls_start + i,
                id=call.id,
                type=call.type,
                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(new_calls)
        ]
        return DeltaMessage(content=content or None, tool_calls=tool_calls)
