"""Input processing: a prompt to token ids, and the one validator of every request.

The engine and the HTTP layer check requests with the same functions here: the prompt's token ids, the
sampling settings' token ids, and whether the prompt with the output it asks for fits the context.
The HTTP layer runs them before queueing (so a batch is refused as a whole), the engine again when a
request is added (offline callers come straight here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.errors import ContextLengthError, InvalidRequestError
from engine.sampling.params import SamplingParams


def check_token_ids(token_ids: Iterable[int], vocab_size: int, what: str, param: str) -> None:
    """Refuse token ids the model does not have.

    Args:
        token_ids: the ids to check.
        vocab_size: the model's vocabulary size.
        what: how the message names an id (``"prompt token id"``).
        param: the request field to blame.

    Raises:
        InvalidRequestError: for the first id outside ``[0, vocab_size)``.
    """
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    # min and max run in C: a prompt of thousands of ids is checked without a Python loop over them
    if ids and 0 <= min(ids) and max(ids) < vocab_size:
        return
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{what} {token} is outside the vocabulary [0, {vocab_size})", param=param)


def check_text_prompt(prompt: str) -> None:
    """Refuse an empty text prompt (checked before tokenizing: a tokenizer may add a BOS to nothing).

    Raises:
        InvalidRequestError: naming ``prompt``.
    """
    if not prompt:
        raise InvalidRequestError("prompt is empty", param="prompt")


#: margin over the longest vocabulary entry, for normalizers that fold several characters into one
CHARS_PER_TOKEN_MARGIN = 2


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int, param: str = "prompt") -> None:
    """Refuse, before tokenizing it, a text whose characters alone cannot fit in the context.

    One token covers at most ``max_token_chars`` characters (the longest vocabulary entry), so a text
    longer than ``max_model_len * max_token_chars`` needs more tokens than the context holds. The bound
    is taken twice over (:data:`CHARS_PER_TOKEN_MARGIN`): it only spares the tokenizer hopeless work,
    and the token count decides every other case.

    Args:
        num_chars: the text's length in characters.
        max_model_len: the context limit in tokens.
        max_token_chars: the most characters one token covers (``Tokenizer.max_token_chars``).
        param: the request field to blame (``prompt``, ``messages``).

    Raises:
        InvalidRequestError: ``context_length_exceeded``, naming the limit.
    """
    per_token = max(1, max_token_chars) * CHARS_PER_TOKEN_MARGIN
    limit = max_model_len * per_token
    if num_chars > limit:
        what = "the rendered conversation" if param == "messages" else "the prompt"
        raise InvalidRequestError(
            f"{what} has {num_chars} characters, more than this model's context of {max_model_len} tokens can "
            f"hold (at most {limit} characters, {per_token} per token)",
            param=param, code="context_length_exceeded",
        )  # fmt: skip


def check_prompt_token_ids(token_ids: list[Any], vocab_size: int) -> None:
    """Refuse an empty prompt, ids that are not integers, and ids outside the vocabulary.

    Raises:
        InvalidRequestError: naming ``prompt``.
    """
    # the set of the ids' exact types, built in C (bools are ints to isinstance, not here)
    if not set(map(type, token_ids)) <= {int}:
        raise InvalidRequestError("prompt token ids must be integers", param="prompt")
    if not token_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    check_token_ids(token_ids, vocab_size, "prompt token id", "prompt")


def check_params_against_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids a request's sampling settings name that the model does not have.

    Args:
        params: the request's sampling settings.
        vocab_size: the model's vocabulary size.

    Raises:
        InvalidRequestError: a logit_bias key or stop token id is outside ``[0, vocab_size)``.
    """
    check_token_ids(params.logit_bias or {}, vocab_size, "logit_bias token id", "logit_bias")
    check_token_ids(params.stop_token_ids or [], vocab_size, "stop_token_ids entry", "stop_token_ids")
    check_token_ids(params.allowed_token_ids or [], vocab_size, "allowed_token_ids entry", "allowed_token_ids")


def bad_word_sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences that spell each bad word, alone and after a space (how it appears mid-text),
    without special tokens; duplicates once."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode_plain(text)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, max_tokens_param: str = "max_tokens"
) -> None:
    """Refuse a prompt that, with the output it asks for, does not fit in the context.

    Args:
        num_prompt_tokens: the prompt's length.
        max_tokens: the most tokens the request may generate; None for "until the context is full".
        max_model_len: the context limit, prompt plus output.
        max_tokens_param: the request field that set ``max_tokens``.

    Raises:
        ContextLengthError: when no token would be left to generate (naming ``prompt``), or the prompt
            plus ``max_tokens`` exceeds the context (naming ``max_tokens_param``).
    """
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"prompt has {num_prompt_tokens} tokens but the context length is {max_model_len}; "
            "at least one token must be left to generate",
            "prompt", num_prompt_tokens, None, max_model_len,
        )  # fmt: skip
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context length "
            f"{max_model_len}",
            max_tokens_param, num_prompt_tokens, max_tokens, max_model_len,
        )  # fmt: skip


def check_cache_salt(cache_salt: object) -> None:
    """Refuse a prefix-cache salt that is not a non-empty string (None: no salt).

    Raises:
        InvalidRequestError: naming ``cache_salt``.
    """
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt must be a non-empty string when given", param="cache_salt")


class InputProcessor:
    """Tokenizes and validates the requests of one engine.

    Args:
        tokenizer: the engine's tokenizer (``encode(text)``).
        vocab_size: the model's vocabulary size.
        max_model_len: the engine's context limit, prompt plus output.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a list of ids is copied as it is).

        Raises:
            InvalidRequestError: for an empty text prompt, or one whose characters cannot fit the context.
        """
        if isinstance(prompt, str):
            check_text_prompt(prompt)
            check_prompt_chars(len(prompt), self.max_model_len, self.tokenizer.max_token_chars)
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def tokenize_many(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """:meth:`tokenize` for several prompts, the texts encoded in one call to the tokenizer (the Rust
        backend spreads a batch over the cores).

        Raises:
            InvalidRequestError: as :meth:`tokenize`, for the first prompt that fails.
        """
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            check_text_prompt(text)
            check_prompt_chars(len(text), self.max_model_len, self.tokenizer.max_token_chars)
        encoded = iter(self.tokenizer.encode_many(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    def validate(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None) -> list[int]:
        """Tokenize and check a request without queueing it.

        Args:
            prompt: text, or token ids.
            params: the request's sampling settings.
            cache_salt: the request's prefix-cache salt, if any.

        Returns:
            The prompt token ids.

        Raises:
            InvalidRequestError: for settings that are not :class:`SamplingParams`, an empty prompt,
                token ids outside the vocabulary (prompt, logit_bias, stop_token_ids), a prompt that
                (with ``max_tokens``) does not fit the context (:class:`ContextLengthError`), or an
                empty cache salt.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        check_prompt_token_ids(token_ids, self.vocab_size)
        check_context_length(len(token_ids), params.max_tokens, self.max_model_len)
        check_params_against_vocab(params, self.vocab_size)
        check_cache_salt(cache_salt)
        if params.bad_words and not params.bad_words_token_ids:
            params.set_bad_words_token_ids(bad_word_sequences(self.tokenizer, params.bad_words))
        return token_ids
