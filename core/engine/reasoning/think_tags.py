"""Thinking between ``<think>`` and ``</think>``, as DeepSeek R1, Qwen 3 and their descendants write it.

The families differ only in the opening tag: some chat templates put ``<think>`` in the prompt, so the
output starts inside the thinking; others leave the model to write it, and a model that does not
(Qwen 3 with ``enable_thinking=False``) is not thinking at all. Whitespace next to the tags is not
part of either field: the reasoning is stripped, and the answer loses the blank line after ``</think>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from engine.reasoning.base import ReasoningDelta, ReasoningParser, TextReasoningStream, held_back

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkTagReasoningParser(ReasoningParser):
    """``<think>reasoning</think>answer``, the opening tag required or optional per subclass.

    Args:
        tokenizer: the model's tokenizer, for :meth:`is_reasoning_end` on token ids.
    """

    start_marker: ClassVar[str] = THINK_START
    end_marker: ClassVar[str] = THINK_END
    #: True: an output that does not open with the start marker has no thinking (all answer).
    #: False: the output starts inside the thinking whether or not it repeats the start marker.
    start_marker_required: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._start_id = single_token_id(tokenizer, self.start_marker)
        self._end_id = single_token_id(tokenizer, self.end_marker)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        stream = ThinkTagStream(self)
        stream.feed(model_output)
        stream.finish()
        return stream.reasoning_content or None, stream.content or None

    def start_stream(self) -> ThinkTagStream:
        return ThinkTagStream(self)

    def is_reasoning_end(self, output: str | Sequence[int]) -> bool:
        if isinstance(output, str):
            return self._text_reasoning_end(output)
        ids = list(output)
        if self._end_id is None or (self.start_marker_required and self._start_id is None):
            # a marker is not one token of this vocabulary: read the text instead
            if self.tokenizer is None:
                raise ValueError(f"{type(self).__name__} needs a tokenizer to read token ids")
            return self._text_reasoning_end(self.tokenizer.decode(ids, skip_special_tokens=False))
        if not self.start_marker_required:
            return self._end_id in ids
        if not ids:
            return False
        return ids[0] != self._start_id or self._end_id in ids[1:]

    def _text_reasoning_end(self, text: str) -> bool:
        if self.start_marker_required:
            head = text.lstrip()
            if not head.startswith(self.start_marker):
                # undecided while the output may still be opening with the start marker
                return not self.start_marker.startswith(head)
        return self.end_marker in text


def single_token_id(tokenizer: Any, marker: str) -> int | None:
    """The id of ``marker`` when the tokenizer has it as one token, else None."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    try:
        token_id = convert(marker)
    except (KeyError, ValueError, TypeError):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return token_id if isinstance(token_id, int) and token_id != unk else None


class ThinkTagStream(TextReasoningStream):
    """One output through the three phases: deciding how it opens, thinking, answering.

    Args:
        parser: the family's parser (its markers and whether the start marker is required).
    """

    _OPENING, _THINKING, _ANSWERING = range(3)

    def __init__(self, parser: ThinkTagReasoningParser) -> None:
        super().__init__()
        self._start = parser.start_marker
        self._end = parser.end_marker
        self._required = parser.start_marker_required
        self._phase = self._OPENING
        self._pending_ws = ""  # reasoning whitespace kept until we know the end marker is not next
        self._reasoning_begun = False
        self._strip_answer_start = False  # the answer follows the end marker: drop its leading blank

    def _advance(self, final: bool) -> ReasoningDelta | None:
        reasoning_start, content_start = len(self._reasoning), len(self._content)
        text = self._text
        if self._phase == self._OPENING:
            first = len(text) - len(text.lstrip())
            head = text[first:]
            if head.startswith(self._start):
                self._pos = first + len(self._start)
                self._phase = self._THINKING
            elif not final and self._start.startswith(head):
                return None  # whitespace so far, or the start marker's first characters
            else:
                self._phase = self._ANSWERING if self._required else self._THINKING
        if self._phase == self._THINKING:
            end = text.find(self._end, self._pos)
            if end >= 0:
                self._add_reasoning(text[self._pos : end])
                self._pending_ws = ""
                self._pos = end + len(self._end)
                self._phase = self._ANSWERING
                self._strip_answer_start = True
            else:
                safe = len(text) if final else len(text) - held_back(text, self._pos, (self._end,))
                self._add_reasoning(text[self._pos : safe])
                self._pos = safe
        if self._phase == self._ANSWERING:
            piece = text[self._pos :]
            self._pos = len(text)
            if self._strip_answer_start:
                piece = piece.lstrip()
                self._strip_answer_start = not piece
            if piece:
                self._content.append(piece)
        reasoning = "".join(self._reasoning[reasoning_start:])
        content = "".join(self._content[content_start:])
        if not reasoning and not content:
            return None
        return ReasoningDelta(reasoning_content=reasoning or None, content=content or None)

    def _add_reasoning(self, piece: str) -> None:
        if not self._reasoning_begun:
            piece = piece.lstrip()
            if not piece:
                return
            self._reasoning_begun = True
        held = self._pending_ws + piece
        kept = held.rstrip()
        self._pending_ws = held[len(kept) :]
        if kept:
            self._reasoning.append(kept)

