"""Errors the engine raises for a caller's mistake, as opposed to its own bugs."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work; ``str(err)`` is a one-line message.

    Attributes:
        param: the offending request field, when one is to blame.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; the caller should retry later."""
