"""Start-up progress: each slow phase of building an engine says what it does and how long it took."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("engine.startup")


@contextlib.contextmanager
def timed_phase(doing: str, done: str) -> Iterator[None]:
    """Log ``doing`` when the phase starts and ``done`` with its duration when it ends (at INFO).

    A phase that raises logs nothing more: the error is what the user sees.

    Args:
        doing: what starts, e.g. ``"loading the weights of X"``.
        done: what finished, e.g. ``"loaded the weights"``; `` in N.N s`` is appended.

    Yields:
        Nothing; the body is the phase.
    """
    logger.info("%s...", doing)
    started = time.perf_counter()
    yield
    logger.info("%s in %.1f s", done, time.perf_counter() - started)


__all__ = ["timed_phase"]
