"""A request's outputs as an async iterator on the event loop, fed by the engine's thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine's step raised, or the engine was shut down, while this request was in flight."""


class RequestStream:
    """The outputs of one request, as an async iterator living on the event loop.

    The engine's outputs are cumulative, so a consumer slower than the engine only needs the latest one:
    the stream keeps just that, which bounds memory however slow a client reads.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.aborted = False
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._event = asyncio.Event()

    # Called on the event loop (via call_soon_threadsafe from the engine thread).
    def _deliver(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished:
            self._closed = True
        self._event.set()

    def _finish(self, aborted: bool, error: BaseException | None) -> None:
        self.aborted = self.aborted or aborted
        self._error = error
        self._closed = True
        self._event.set()

    @property
    def finished(self) -> bool:
        return self._closed and self._latest is None

    @property
    def closed(self) -> bool:
        """Whether the engine is done with this request (its last output may still be unread)."""
        return self._closed

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                return out
            if self._closed:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
