"""What crosses between the event loop and :class:`~engine.async_engine.AsyncLLMEngine`'s engine thread.

Inbound, coroutines put commands (:class:`_Add`, :class:`_Abort`, :class:`_AbortAll`, :class:`_Stop`, and
:class:`~engine.engine_calls.EngineCall`) on the engine thread's queue. Outbound, the engine thread hands
private copies of each step's outputs (:func:`_snapshot`) and acceptances or refusals to the event loop,
which runs :func:`_deliver_all` and :func:`_resolve` there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.engine_calls import EngineCall
from engine.outputs import PoolingRequestOutput, RequestOutput
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


def _snapshot(output: RequestOutput) -> RequestOutput:
    # The engine may keep mutating its output objects in later steps; hand the loop a private copy.
    if isinstance(output, PoolingRequestOutput):
        return output  # made once, when the request finished
    outs = [
        dataclasses.replace(
            c, token_ids=list(c.token_ids), logprobs=list(c.logprobs) if c.logprobs is not None else None
        )
        for c in output.outputs
    ]
    return dataclasses.replace(output, outputs=outs, prompt_token_ids=output.prompt_token_ids)


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

