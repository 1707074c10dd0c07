"""gpt-oss's output in OpenAI's harmony format: messages on channels, the thinking on ``analysis``::

    <|channel|>analysis<|message|>The user wants...<|end|><|start|>assistant<|channel|>final<|message|>Hi!

A message is a header (``<|start|>`` and a role, ``<|channel|>`` and the channel, maybe a recipient
``to=functions.NAME`` and a ``<|constrain|>`` format) up to ``<|message|>``, then its body up to ``<|end|>``,
``<|call|>`` or ``<|return|>`` (the stop tokens usually not in the output: the output's end ends it too).
``analysis`` bodies are the reasoning; ``final`` and recipient-less ``commentary`` (a preamble) bodies are
the answer; a message to a function is passed on in the answer as ``<|channel|>commentary
to=functions.NAME<|message|>ARGS<|call|>``, which the ``openai`` tool parser reads as a call. Text before
any header (a model that does not write harmony) is answer. The markers are special tokens, so the server
detokenizes with ``skip_special_tokens=False`` for this parser.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

from engine.reasoning.base import ReasoningDelta, ReasoningParser, TextReasoningStream, held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_STARTS = (START, CHANNEL)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class GptOssReasoningParser(ReasoningParser):
    """Harmony's ``analysis`` channel as the reasoning, the other channels as the answer."""

    needs_special_tokens: ClassVar[bool] = True

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        stream = HarmonyStream()
        stream.feed(model_output)
        stream.finish()
        return stream.reasoning_content or None, stream.content or None

    def start_stream(self) -> HarmonyStream:
        return HarmonyStream()

    def is_reasoning_end(self, output: str | Sequence[int]) -> bool:
        if not isinstance(output, str):
            if self.tokenizer is None:
                raise ValueError(f"{type(self).__name__} needs a tokenizer to read token ids")
            output = self.tokenizer.decode(list(output), skip_special_tokens=False)
        stream = HarmonyStream()
        stream.feed(output)
        return stream.answer_begun


class HarmonyStream(TextReasoningStream):
    """One output's messages, fed in pieces: each message's header is held until ``<|message|>`` decides
    where its body goes, and a body's last characters are held while they could begin an end marker."""

    def __init__(self) -> None:
        super().__init__()
        self._route: str | None = None  # the open message's destination: "reasoning", "content" or "call"
        self._answer_begun = False

    @property
    def answer_begun(self) -> bool:
        """Whether a message other than the thinking (or text outside harmony) has begun."""
        return self._answer_begun

    def _advance(self, final: bool) -> ReasoningDelta | None:
        reasoning_start, content_start = len(self._reasoning), len(self._content)
        while self._pos < len(self._text) and self._step(final):
            pass
        if final and self._route is not None:  # the stop token ended the last message
            self._close()
        reasoning = "".join(self._reasoning[reasoning_start:])
        content = "".join(self._content[content_start:])
        if not reasoning and not content:
            return None
        return ReasoningDelta(reasoning_content=reasoning or None, content=content or None)

    def _step(self, final: bool) -> bool:
        """Move past what the text so far decides; False when more text is needed."""
        text, pos = self._text, self._pos
        if self._route is None:
            if text.startswith(HEADER_STARTS, pos):
                return self._header(final)
            # text outside any message: answer, up to a header (held while it may be one's first characters)
            following = [i for i in (text.find(m, pos) for m in HEADER_STARTS) if i >= 0]
            safe = min(following) if following else len(text) if final else len(text) - held_back(text, pos, HEADER_STARTS)
            if safe > pos:
                self._answer(text[pos:safe])
                self._pos = safe
                return True
            return False
        ends = [(i, m) for i, m in ((text.find(m, pos), m) for m in BODY_ENDS) if i >= 0]
        if ends:
            end, marker = min(ends)
            self._body(text[pos:end])
            self._close()
            self._pos = end + len(marker)
            return True
        safe = len(text) if final else len(text) - held_back(text, pos, BODY_ENDS)
        if safe > pos:
            self._body(text[pos:safe])
            self._pos = safe
        return False

    def _header(self, final: bool) -> bool:
        text, pos = self._text, self._pos
        body = text.find(MESSAGE, pos)
        if body < 0:
            if final:  # a header the output ended in: nothing to say
                self._pos = len(text)
            return final
        header = text[pos:body]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._route = "call"
            self._answer(f"{CHANNEL}commentary to={recipient.group(1)}{MESSAGE}")
        elif channel is not None and channel.group(1) == "analysis":
            self._route = "reasoning"
        else:
            self._route = "content"
            self._answer_begun = True
        self._pos = body + len(MESSAGE)
        return True

    def _body(self, piece: str) -> None:
        if not piece:
            return
        if self._route == "reasoning":
            self._reasoning.append(piece)
        else:
            self._answer(piece)

    def _close(self) -> None:
        if self._route == "call":
            self._answer("<|call|>")
        self._route = None

    def _answer(self, piece: str) -> None:
        self._answer_begun = True
        self._content.append(piece)

