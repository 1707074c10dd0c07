"""Running the app under uvicorn: a deadline on request headers, and a shutdown that ends every stream.

uvicorn's own graceful shutdown stops accepting and waits for the requests in flight, but when its timeout
runs out it cancels their tasks, which cuts streamed responses mid-body. Here the wait is split in two:
the grace period, after which the engine aborts whatever still runs (each handler then ends its response
properly, with ``finish_reason: "abort"`` and ``data: [DONE]``), and a short drain for those last chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)

#: seconds the responses get, after the grace period's aborts, to send their last chunks
DRAIN_TIMEOUT_S = 10.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown aborts, through the engine, what outlives the grace period.

    Args:
        config: uvicorn's configuration; its ``timeout_graceful_shutdown`` is replaced by
            ``grace_s + DRAIN_TIMEOUT_S``.
        grace_s: seconds the requests in flight may run on after SIGINT/SIGTERM.
        abort_in_flight: aborts every request in flight (``AsyncLLMEngine.abort_all``); None leaves
            uvicorn's cancelling in place.
    """

    def __init__(self, config: uvicorn.Config, grace_s: float, abort_in_flight: Callable[[], None] | None) -> None:
        config.timeout_graceful_shutdown = grace_s + DRAIN_TIMEOUT_S if abort_in_flight else grace_s  # type: ignore[assignment]
        super().__init__(config)
        self._grace_s = grace_s
        self._abort_in_flight = abort_in_flight

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, let the requests run for the grace period, abort the rest, then stop."""
        timer = None
        if self._abort_in_flight is not None:
            timer = asyncio.get_running_loop().call_later(self._grace_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _grace_over(self) -> None:
        if not self.server_state.tasks:
            return
        logger.info(
            "the shutdown grace period (%gs) is over: aborting %d request(s) still running",
            self._grace_s, len(self.server_state.tasks),
        )  # fmt: skip
        assert self._abort_in_flight is not None  # the timer is set only with it
        self._abort_in_flight()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; a clean stop exits 0 instead."""
        with super().capture_signals():
            yield
            stopped_by = list(self._captured_signals)
            self._captured_signals.clear()
        if stopped_by:
            logger.info("stopped by signal %s", ", ".join(str(s) for s in stopped_by))


class _HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol: a connection must complete each request's headers in time.

    uvicorn closes a connection that stays idle after a response, but not one that sends its headers a
    byte at a time (or opens and sends nothing), so a few such clients could hold connections forever.
    The deadline is armed when a connection opens and after each response, and checked when it fires:
    a connection in the middle of a request has sent its headers and is left alone.
    """

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    # uvicorn's protocol provides these
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    client: tuple[str, int] | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        # armed before uvicorn starts a pipelined request, whose headers are then already complete
        self._arm_header_deadline()
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its headers came in time
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("%s sent no complete request headers within %gs; closed the connection", who, self.header_timeout_s)
        self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with a header deadline.

    Args:
        timeout_s: seconds a connection has, from opening or from its last response, to complete the
            headers of its next request.

    Returns:
        A protocol class to pass as uvicorn's ``http`` setting.
    """
    return type("HeaderDeadlineProtocol", (_HeaderDeadline, AutoHTTPProtocol), {"header_timeout_s": timeout_s})

