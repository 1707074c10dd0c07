"""When a sequence is done: EOS, stop tokens, stop strings, max_tokens and the context limit."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling.params import SamplingParams


@dataclass(slots=True)
class StopDecision:
    """Why and where a sequence ended.

    Attributes:
        finish_reason: ``"stop"`` (EOS, stop token or stop string) or ``"length"``.
        stop_reason: the matched stop string or stop token id; None for EOS or length.
        text_end: cut the text to ``text[:text_end]``; None keeps all of it.
    """

    finish_reason: str
    stop_reason: str | int | None
    text_end: int | None


class StopChecker:
    """Decides, after each generated token, whether a sequence is finished.

    Args:
        params: the request's sampling settings.
        eos_token_ids: the model's end-of-sequence tokens.
        max_model_len: the context limit, prompt plus output.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], max_model_len: int) -> None:
        self._params = params
        self._eos_token_ids = frozenset(eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids or ())
        self._stop_strings = tuple(params.stop or ())
        self._longest_stop = max((len(s) for s in self._stop_strings), default=0)
        self._max_model_len = max_model_len

    def check(
        self, output_token_ids: list[int], total_len: int, text: str, new_text_len: int
    ) -> StopDecision | None:
        """Check the sequence right after a token was appended.

        EOS (unless ``ignore_eos``), stop tokens and stop strings count only once ``min_tokens`` tokens
        were generated; the length limits always count. EOS and stop tokens cut their own text (what the
        last step added) unless ``include_stop_str_in_output``, so it never reaches the client.

        Args:
            output_token_ids: the generated tokens, the new one last.
            total_len: prompt plus output length.
            text: the generated text so far, the new token's text included.
            new_text_len: how many characters at the end of ``text`` the new token added.

        Returns:
            The decision when the sequence is finished, else None.
        """
        p = self._params
        num_output = len(output_token_ids)
        if output_token_ids and num_output >= p.min_tokens:
            last = output_token_ids[-1]
            if not p.ignore_eos and last in self._eos_token_ids:
                return StopDecision("stop", None, self._cut_token_text(text, new_text_len))
            if last in self._stop_token_ids:
                return StopDecision("stop", last, self._cut_token_text(text, new_text_len))
            matched = self._find_stop_string(text, new_text_len)
            if matched is not None:
                return matched
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return StopDecision("length", None, None)
        if total_len >= self._max_model_len:
            return StopDecision("length", None, None)
        return None

    def _cut_token_text(self, text: str, new_text_len: int) -> int | None:
        if new_text_len <= 0 or self._params.include_stop_str_in_output:
            return None
        return len(text) - new_text_len

    def _find_stop_string(self, text: str, new_text_len: int) -> StopDecision | None:
        if not self._stop_strings or new_text_len <= 0:
            return None
        # A new match must overlap the new text, so it starts at most longest-1 characters before it.
        search_from = max(0, len(text) - new_text_len - self._longest_stop + 1)
        best_index = -1
        best_stop = ""
        for stop in self._stop_strings:
            index = text.find(stop, search_from)
            if index != -1 and (best_index == -1 or index < best_index):
                best_index, best_stop = index, stop
        if best_index == -1:
            return None
        end = best_index + len(best_stop) if self._params.include_stop_str_in_output else best_index
        return StopDecision("stop", best_stop, end)

    def streamable_len(self, text: str) -> int:
        """How much of a running sequence's text a streaming client may see now.

        Holds back the longest end of ``text`` that could be the start of a stop string, so a stop
        string is never shown in part and then retracted.

        Args:
            text: the generated text so far.

        Returns:
            The number of leading characters of ``text`` that are safe to show.
        """
        if not self._stop_strings or self._params.include_stop_str_in_output:
            return len(text)
        for held in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-held:]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return len(text) - held
        return len(text)
