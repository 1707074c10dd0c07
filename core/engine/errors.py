"""Errors the engine raises for a caller's mistake, as opposed to its own bugs."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work; ``str(err)`` is a one-line message.

    Attributes:
        param: the offending request field, when one is to blame.
        code: a short machine-readable reason, when there is one (the HTTP layer reports it).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt, with the output it asks for, does not fit in the model's context.

    Attributes:
        num_prompt_tokens: the prompt's length.
        max_tokens: the output length asked for; None when the prompt alone is too long.
        max_model_len: the context limit, prompt plus output.
    """

    def __init__(self, message: str, param: str, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; the caller should retry later."""


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank is gone): the requests in flight fail and the
    server stops, where a failed step would only fail its own requests."""


class EngineConfigError(ValueError):
    """The configuration cannot run on the selected platform; the message lists every reason."""
