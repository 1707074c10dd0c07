"""What crosses between the event loop and :class:`~engine.async_engine.AsyncLLMEngine`'s engine thread.

Inbound, coroutines put commands (:class:`_Add`, :class:`_Abort`, :class:`_AbortAll`, :class:`_Stop`, and
:class:`~engine.engine_calls.EngineCall`) on the engine thread's queue. Outbound, the engine thread hands
each step's outputs (new objects every step, see ``EngineCore.step``) and acceptances or refusals to the
event loop, which runs :func:`_deliver_all` and :func:`_resolve` there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.engine_calls import EngineCall
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream

if TYPE_CHECKING:
    from engine.lora.request import LoRARequest
    from engine.sampling.params import SamplingParams


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future[None]
    cache_salt: str | None = None
    #: when the caller handed the request over (monotonic seconds), for the observer's timings
    arrival: float = 0.0
    #: lower runs first (0: the default)
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class _AbortAll:
    pass


class _Stop:
    pass


_Command = _Add | _Abort | _AbortAll | _Stop | EngineCall


def _deliver_all(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in deliveries:
        stream._deliver(output)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

