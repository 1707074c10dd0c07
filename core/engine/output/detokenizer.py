"""Incremental detokenisation: turn generated token ids into text one token at a time.

Decoding each token on its own is wrong: byte-level BPE splits multi-byte characters (CJK, emoji)
across tokens, and SentencePiece decoders treat a token at the start of a string differently (they drop
its leading space). Decoding the whole output every step is right but costs O(length) per step.

So each step decodes a short window of recent ids and emits the part of its text not shown yet; the
window's first tokens (already shown) give the new ones their left context. Text is held back while it
ends in U+FFFD, the decoders' mark for an incomplete UTF-8 sequence, until a later token completes the
character. The window then slides forward, so the cost per step stays bounded.
"""

from __future__ import annotations

from typing import Any

#: already shown tokens kept as left context (also how many prompt tokens start the window)
_CONTEXT_TOKENS = 5
#: the window slides once it holds more tokens than this
_MAX_WINDOW_TOKENS = 16
#: a UTF-8 character has at most 4 bytes and every token carries at least one, so more pending tokens
#: than this mean the text ends in invalid bytes, not in an unfinished character; then all but the last
#: character is shown (exact for byte-level BPE, whose decoder gives one U+FFFD per unfinished character)
_MAX_PENDING_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenises one sequence's generated tokens as they arrive.

    The concatenation of every ``step`` result and ``flush`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the prompt; its last few tokens are the left context of the first output.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        # A prompt that ends inside a character would lend its first bytes to the output's first
        # character; the output text must stand on its own, so such a prompt gives no context.
        if context_text.endswith(_REPLACEMENT_CHAR):
            context, context_text = [], ""
        self._ids: list[int] = context
        self._start = 0  # window start in _ids
        self._emitted = len(context_text)  # characters of decode(_ids[_start:]) already shown
        self._pending = 0  # tokens appended since the text last ended on a whole character
        self._text_parts: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def step(self, token_id: int) -> str:
        """Append one generated token.

        Args:
            token_id: the token just generated.

        Returns:
            The newly completed text; ``""`` while the text so far ends in an incomplete character.
        """
        self._ids.append(token_id)
        self._pending += 1
        window_text = self._decode(self._ids[self._start :])
        if window_text.endswith(_REPLACEMENT_CHAR):
            if self._pending <= _MAX_PENDING_TOKENS:
                return ""
            stable_len = len(window_text) - 1
        else:
            stable_len = len(window_text)
            self._pending = 0
        new_text = window_text[self._emitted : stable_len]
        self._emitted = max(self._emitted, stable_len)
        if len(self._ids) - self._start > _MAX_WINDOW_TOKENS:
            self._slide(window_text)
        if new_text:
            self._text_parts.append(new_text)
        return new_text

    def _slide(self, window_text: str) -> None:
        """Move the window start to a later token where decoding can restart without changing the text.

        A cut qualifies when the text from it is the tail of the window's text (so nothing before it
        reaches across), does not start with U+FFFD (it would split a character), covers only shown
        text before it, and leaves the last few tokens (where an unfinished character lives) whole.
        """
        for cut in range(len(self._ids) - _CONTEXT_TOKENS, self._start, -1):
            tail = self._decode(self._ids[cut:])
            dropped = len(window_text) - len(tail)
            if (
                window_text.endswith(tail)
                and not tail.startswith(_REPLACEMENT_CHAR)
                and 0 <= dropped <= self._emitted
            ):
                self._start = cut
                self._emitted -= dropped
                # Only the window is decoded again; dropping what is before it keeps memory bounded.
                del self._ids[: self._start]
                self._start = 0
                return

    def flush(self) -> str:
        """Emit whatever is held back, incomplete characters as U+FFFD; call once the sequence finished.

        Returns:
            The text not yet returned by ``step``.
        """
        window_text = self._decode(self._ids[self._start :])
        new_text = window_text[self._emitted :]
        self._emitted = max(self._emitted, len(window_text))
        self._pending = 0
        if new_text:
            self._text_parts.append(new_text)
        return new_text

    def decode_all(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` in one decode, for a sequence that never called :meth:`step`.

        Equals the concatenation of :meth:`step` over ``output_ids`` and :meth:`flush` (same left context),
        at the cost of one decode instead of one per token.

        Raises:
            RuntimeError: if :meth:`step` was already called.
        """
        if self._pending or self._text_parts or self._start:
            raise RuntimeError("decode_all() is for a detokenizer that has not stepped yet")
        return self._decode(self._ids + list(output_ids))[self._emitted :]

    @property
    def text(self) -> str:
        """All text returned so far by ``step`` and ``flush``."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""
