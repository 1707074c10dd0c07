"""The reasoning parser interface: separating a reasoning model's thinking from its answer.

The answer is OpenAI's ``content``; the thinking goes in the ``reasoning_content`` field that
DeepSeek's API introduced and clients of reasoning models read. The engine also asks a parser whether
the thinking is over (:meth:`ReasoningParser.is_reasoning_end`), so that structured output constrains
the answer and not the thinking before it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ReasoningDelta:
    """What one step of a stream adds to each field; None where a field gets nothing this step."""

    reasoning_content: str | None = None
    content: str | None = None

    def to_dict(self) -> dict[str, str]:
        """The fields of an OpenAI ``delta`` this step sets."""
        out: dict[str, str] = {}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        return out


class ReasoningStream(ABC):
    """The state of one streamed output: fed its deltas in order, then finished."""

    @abstractmethod
    def feed(self, delta_text: str) -> ReasoningDelta | None:
        """Take the next piece of the output.

        Args:
            delta_text: the text generated since the last call (may be empty).

        Returns:
            The reasoning and/or content that became certain; None when nothing did yet (text that
            may be part of a marker, such as a trailing ``</thi``, is held back).

        Raises:
            RuntimeError: the stream was already finished.
        """

    @abstractmethod
    def finish(self) -> ReasoningDelta | None:
        """End the output and release what was held back.

        Returns:
            The last reasoning and/or content, or None; a second call returns None.
        """


class TextReasoningStream(ReasoningStream):
    """A stream that keeps the whole output so far and re-reads it from its own position on each piece:
    subclasses implement :meth:`_advance`."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0
        self._finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def reasoning_content(self) -> str:
        """All reasoning released so far."""
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        """All answer text released so far."""
        return "".join(self._content)

    def feed(self, delta_text: str) -> ReasoningDelta | None:
        if self._finished:
            raise RuntimeError("feed() after finish(): a reasoning stream parses one output")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta | None:
        if self._finished:
            return None
        delta = self._advance(final=True)
        self._finished = True
        return delta

    @abstractmethod
    def _advance(self, final: bool) -> ReasoningDelta | None:
        """Release what the text so far decides (all of it when ``final``)."""


def held_back(text: str, pos: int, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text[pos:]`` could begin one of ``markers`` (a stream holds
    them until the next piece says)."""
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text) - pos), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return held


class ReasoningParser(ABC):
    """How one model family marks its thinking. Stateless, so one instance serves every request;
    :meth:`start_stream` returns the per-request state of a streamed output.

    For every output, the concatenated deltas of a stream equal :meth:`extract_reasoning`'s result
    (None standing for the empty string), wherever the deltas are cut.

    Args:
        tokenizer: the model's tokenizer; needed only for :meth:`is_reasoning_end` on token ids.
    """

    #: the markers are special tokens: the server must detokenize with ``skip_special_tokens=False`` for
    #: this parser to see them
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """Split a finished output into thinking and answer. Never raises on what the model wrote.

        Args:
            model_output: the whole generated text.

        Returns:
            ``(reasoning_content, content)``, each None when empty.
        """

    @abstractmethod
    def start_stream(self) -> ReasoningStream:
        """State for parsing one streamed output."""

    @abstractmethod
    def is_reasoning_end(self, output: str | Sequence[int]) -> bool:
        """Whether the thinking is over in an output so far (so what follows is the answer).

        Args:
            output: the generated text so far, or its token ids.

        Returns:
            True once the answer has begun or the output has no thinking at all; False while the
            model may still be thinking.

        Raises:
            ValueError: token ids were given and the parser has no tokenizer to read them.
        """
