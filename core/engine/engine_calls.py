"""Calls that :class:`~engine.async_engine.AsyncLLMEngine` runs on its engine thread for a coroutine.

The engine is not thread-safe, so work on it other than adding and aborting requests (registering or
removing a LoRA adapter, listing them) travels the same command queue: the coroutine puts an
:class:`EngineCall` and awaits its future, which the engine thread settles with the call's result or the
exception it raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCall:
    """``fn(engine)`` to run on the engine thread, and the caller's future for its outcome.

    Attributes:
        fn: the work; it gets the synchronous engine.
        done: a future of the caller's event loop.
    """

    fn: Callable[[Any], Any]
    done: asyncio.Future[Any]

    def run(self, engine: Any) -> None:
        """Run the call (on the engine thread) and hand its result or exception to the caller."""
        try:
            result = self.fn(engine)
        except Exception as exc:  # the caller's to handle: a refused adapter is a client's mistake
            self.settle(None, exc)
            return
        self.settle(result, None)

    def settle(self, result: Any, error: BaseException | None) -> None:
        """Resolve the caller's future from any thread: with ``error`` when given, else ``result``."""
        try:
            self.done.get_loop().call_soon_threadsafe(_set, self.done, result, error)
        except RuntimeError:
            # the caller's event loop is closed (process exiting): nobody is left to tell
            logger.debug("event loop closed; dropping the result of an engine call")


def _set(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
