"""What the chat and completion handlers share: sampling settings, admission, deltas, logprobs, aborts.

Reading and validating a request body is :mod:`engine.entrypoints.openai.request_body`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError

from engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from engine.beam_search import BeamSearchParams
from engine.entrypoints.openai.errors import OpenAIError, bad_request, from_validation_error
from engine.entrypoints.openai.limits import RequestLimits
from engine.entrypoints.openai.protocol import SamplingFields
from engine.entrypoints.openai.request_body import DEFAULT_MAX_BODY_BYTES
from engine.entrypoints.openai.request_fields import UnknownFieldLog
from engine.entrypoints.openai.structured_fields import constraint_field, request_constraint
from engine.errors import ContextLengthError, InvalidRequestError, QueueFullError
from engine.input_processor import (
    check_cache_salt,
    check_context_length,
    check_params_against_vocab,
    check_prompt_token_ids,
    check_token_ids,
)
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, Logprob
from engine.sampling.params import SamplingParams

ResultT = TypeVar("ResultT")

#: the ``Retry-After`` of a 503 for a full queue, in seconds: queued requests start within steps
RETRY_AFTER_S = "1"
#: the sampling fields a request may leave unset (None) for the checkpoint's or the engine's default
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: inputs of fewer characters (or token ids) than this are tokenized on the event loop: handing them to a
#: thread would cost more than the work (about 2 ms of tokenizing at this size)
OFF_LOOP_MIN_SIZE = 4096


@dataclass(slots=True)
class ServingContext:
    """What every handler needs to know about the server.

    Attributes:
        engine: the running async engine.
        served_model_names: names the ``model`` field may carry; the first is reported.
        vocab_size: number of token ids the model knows.
        max_body_bytes: largest accepted request body.
        limits: how much work one request may ask for.
        allow_special_tokens_in_messages: read special-token strings typed in chat messages as special
            tokens (``--allow-special-tokens-in-messages``, for trusted clients only).
        executor: the threads that tokenize, render chat templates and detokenize large inputs, so that
            the event loop keeps answering meanwhile (the tokenizers' Rust code releases the GIL).
        created: when the server started (unix seconds), reported as the model's ``created``.
        generation_defaults: the checkpoint's sampling defaults (``LLMEngine.generation_defaults``), used
            for each of those fields a request leaves unset.
        unknown_fields: the undeclared request fields already logged (``request_fields``).
        lora_requests: the LoRA adapters ``model`` may name, by name (``--lora-modules``, and
            ``/v1/load_lora_adapter`` in :mod:`~engine.entrypoints.openai.serving_models`).
    """

    engine: AsyncLLMEngine
    served_model_names: list[str]
    vocab_size: int
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: RequestLimits = field(default_factory=RequestLimits)
    allow_special_tokens_in_messages: bool = False
    executor: ThreadPoolExecutor = field(default_factory=lambda: tokenizer_pool())
    created: int = field(default_factory=lambda: int(time.time()))
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    unknown_fields: UnknownFieldLog = field(default_factory=UnknownFieldLog)
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> None:
        """Refuse a ``model`` that is neither a served name of the base model nor an adapter's (404)."""
        if requested is not None and requested not in self.served_model_names and requested not in self.lora_requests:
            raise OpenAIError(
                404,
                f"the model {requested!r} does not exist; this server serves {[*self.served_model_names, *self.lora_requests]}",
                param="model",
                code="model_not_found",
            )

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter ``model`` names; None for the base model (or no ``model``). Raises a 404 for an
        unknown name."""
        self.check_model(requested)
        return None if requested is None else self.lora_requests.get(requested)

    def check_base_model(self, requested: str | None) -> None:
        """:meth:`check_model` for the pooling routes, which do not run adapters yet (a 400 naming ``model``)."""
        if self.lora_request(requested) is not None:
            raise bad_request(f"{requested!r} is a LoRA adapter; pooling requests run on the base model only", param="model")

    def reported_model(self, requested: str | None) -> str:
        """The ``model`` a response reports: the adapter's name for an adapter, else the base model's."""
        return requested if requested is not None and requested in self.lora_requests else self.model_name

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Refuse ids outside the model's vocabulary with a 400 naming ``param``."""
        with refused_as_bad_request():
            check_token_ids(ids, self.vocab_size, "token id", param)

    async def off_loop(self, size: int, fn: Callable[..., ResultT], *args: Any) -> ResultT:
        """``fn(*args)``, run on :attr:`executor` when the input is large, else right here.

        Args:
            size: the input's size in characters or token ids (compared with :data:`OFF_LOOP_MIN_SIZE`).
            fn: the work: tokenizing, rendering, detokenizing, building a large response.
            args: its arguments.

        Returns:
            What ``fn`` returns; what it raises propagates.
        """
        if size < OFF_LOOP_MIN_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))


def tokenizer_pool() -> ThreadPoolExecutor:
    """The server's tokenizing threads: one core fewer than the machine has (1 to 8), so that however
    much tokenizing clients ask for, a core is left for the event loop and the engine."""
    workers = max(1, min(8, (os.cpu_count() or 2) - 1))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")


@contextlib.contextmanager
def refused_as_bad_request() -> Iterator[None]:
    """Turn the engine validator's refusals (``engine.input_processor``) into 400s naming the field."""
    try:
        yield
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None


def sampling_params(
    req: SamplingFields, ctx: ServingContext, max_tokens: int | None, logprobs: int | None
) -> SamplingParams | BeamSearchParams:
    """Translate the OpenAI fields into the engine's settings; refusals name the field."""
    with refused_as_bad_request():
        check_cache_salt(req.cache_salt)
    ctx.limits.check_n(req.n)
    constraint = request_constraint(req)
    if req.use_beam_search:
        if constraint is not None:
            field = constraint_field(req)
            raise bad_request(f"{field} is not supported with use_beam_search", param=field)
        return beam_search_params(req, max_tokens, logprobs)
    # the keys were checked to be short ASCII integers when the body was parsed (``protocol``)
    bias = {int(key): value for key, value in req.logit_bias.items()} if req.logit_bias else None
    # a field the request leaves unset (None) takes the checkpoint's default, else SamplingParams' own
    unset = {name: value for name, value in ctx.generation_defaults.items() if getattr(req, name, None) is None}
    fields: dict[str, Any] = {
        "n": req.n,
        **{name: getattr(req, name) for name in _DEFAULTABLE if getattr(req, name) is not None},
        **unset,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "logit_bias": bias,
        "seed": req.seed,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
        "skip_special_tokens": req.skip_special_tokens,
        "structured_outputs": constraint,
    }
    try:
        params = SamplingParams(**fields)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    with refused_as_bad_request():
        check_params_against_vocab(params, ctx.vocab_size)
    return params


def beam_search_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> BeamSearchParams:
    """Beam search takes ``n`` as its width; sampling-only fields are refused rather than ignored."""
    if req.stream:
        raise bad_request("streaming is not supported with use_beam_search", param="stream")
    if logprobs is not None:
        raise bad_request("logprobs are not supported with use_beam_search", param="logprobs")
    if req.stop or req.stop_token_ids:
        raise bad_request("stop conditions are not supported with use_beam_search", param="stop")
    if req.n > 10:
        raise bad_request(f"with use_beam_search, n (the beam width) must be at most 10, got {req.n}", param="n")
    return BeamSearchParams(
        beam_width=req.n, max_tokens=max_tokens or 16, length_penalty=req.length_penalty,
        early_stopping=req.early_stopping, ignore_eos=req.ignore_eos,
    )


def check_prompt(
    token_ids: list[int], max_tokens: int | None, max_model_len: int, vocab_size: int, max_tokens_param: str
) -> None:
    """Refuse a prompt before it is queued, with the engine's own checks (``engine.input_processor``).

    Args:
        token_ids: the tokenized prompt.
        max_tokens: the output length asked for, if any.
        max_model_len: the engine's context limit.
        vocab_size: the model's vocabulary size.
        max_tokens_param: the request field that set ``max_tokens``: ``max_tokens`` for completions,
            ``max_completion_tokens`` for chat (whose prompt is its ``messages``).

    Raises:
        OpenAIError: 400 naming the field; ``context_length_exceeded`` when the prompt and the output
            it asks for do not fit.
    """
    # the length first: it costs nothing, and bounds the ids the loop below walks on the event loop
    try:
        check_context_length(len(token_ids), max_tokens, max_model_len, max_tokens_param)
    except ContextLengthError as exc:
        raise _context_error(exc, "messages" if max_tokens_param == "max_completion_tokens" else "prompt") from None
    with refused_as_bad_request():
        check_prompt_token_ids(token_ids, vocab_size)


def _context_error(exc: ContextLengthError, prompt_param: str) -> OpenAIError:
    """The engine's context-length refusal in the API's words (what can be lowered, and to what)."""
    n, limit = exc.num_prompt_tokens, exc.max_model_len
    if exc.max_tokens is None:
        message = f"the prompt has {n} tokens but this model's context is {limit} tokens"
        return bad_request(message, param=prompt_param, code=exc.code)
    param = exc.param
    message = (
        f"this model's context is {limit} tokens, but the prompt has {n} tokens "
        f"and {param} asks for {exc.max_tokens} more; lower {param} to at most {limit - n}"
    )
    return bad_request(message, param=param, code=exc.code)


async def add_request(
    ctx: ServingContext,
    request_id: str,
    prompt: list[int],
    params: SamplingParams | BeamSearchParams,
    cache_salt: str | None = None,
    constraint_param: str | None = None,
    priority: int = 0,
    model: str | None = None,
) -> RequestStream:
    """Hand a request to the engine, mapping its refusals to HTTP errors.

    Args:
        constraint_param: the request field that set ``params.structured_outputs``
            (:func:`constraint_field`): the engine's refusal of the constraint names it instead.
        priority: lower runs first.
        model: the request's ``model``: a LoRA adapter's name runs it under that adapter.
    """
    # resolved here, in the same event-loop turn that queues the request: an unload queued before it
    # has already dropped the name (404), and one queued after it sees the request running (400)
    lora = ctx.lora_request(model)
    extra: dict[str, Any] = {"priority": priority} if priority else {}
    if lora is not None:
        extra["lora_request"] = lora
    try:
        stream = await ctx.engine.add_request(request_id, prompt, params, cache_salt, **extra)
    except InvalidRequestError as exc:
        if exc.param == "lora_request":  # the adapter is what the request chose by its ``model``
            raise bad_request(str(exc), param="model", code=exc.code) from None
        if constraint_param is not None and exc.param == "structured_outputs" and constraint_param != exc.param:
            raise bad_request(f"{constraint_param}: {exc}", param=constraint_param, code=exc.code) from None
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    except QueueFullError as exc:
        raise OpenAIError(
            503, f"the server is busy: {exc}; retry later", code="queue_full", headers={"Retry-After": RETRY_AFTER_S}
        ) from None
    except EngineDeadError as exc:
        raise OpenAIError(503, str(exc), code="engine_unavailable") from None
    ctx.limits.arm_deadline(ctx.engine, stream)
    return stream


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, engine: AsyncLLMEngine, request_ids: list[str]) -> AsyncIterator[None]:
    """Abort ``request_ids`` in the engine as soon as the client hangs up, or if the handler is cancelled.

    The body has been read already, so the next ASGI message can only be the disconnect.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for rid in request_ids:
                    engine.abort(rid)
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    except BaseException:
        for rid in request_ids:
            engine.abort(rid)
        raise
    finally:
        watcher.cancel()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams, yielding ``(stream index, output)`` as each arrives."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield i, item
        for task in tasks:
            task.result()  # re-raise a stream's error
    finally:
        for task in tasks:
            task.cancel()


@dataclass(slots=True)
class DeltaTracker:
    """How much of one completion's text and tokens the client has been sent.

    Text that might still change is held back until the completion ends: a trailing replacement
    character (half of a multi-byte character) and a tail that could be the start of a stop string.
    """

    hold_back: int = 0
    sent_chars: int = 0
    sent_tokens: int = 0

    def next_text(self, output: CompletionOutput) -> str:
        text = output.text
        end = len(text)
        if not output.finished:
            end = max(self.sent_chars, end - self.hold_back)
            while end > self.sent_chars and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_chars : end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        return delta

    def next_tokens(self, output: CompletionOutput) -> tuple[int, int]:
        start, self.sent_tokens = self.sent_tokens, len(output.token_ids)
        return start, self.sent_tokens


def stop_hold_back(stop: list[str] | None) -> int:
    return max((len(s) for s in stop), default=1) - 1 if stop else 0


@dataclass(slots=True)
class TokenLogprobs:
    """One generated token's logprob and the most likely alternatives, decoded."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


def token_logprobs(
    output: CompletionOutput, start: int, end: int, num_top: int, decode: Callable[[int], str]
) -> list[TokenLogprobs]:
    """Logprobs of tokens ``start:end`` of a completion, with ``num_top`` alternatives each."""
    if output.logprobs is None:
        return []
    out: list[TokenLogprobs] = []
    for pos in range(start, min(end, len(output.logprobs), len(output.token_ids))):
        table: dict[int, Logprob] = output.logprobs[pos]
        token_id = output.token_ids[pos]
        chosen = table.get(token_id)
        ranked = sorted(table.items(), key=lambda kv: -kv[1].logprob)[:num_top]
        out.append(
            TokenLogprobs(
                token=_token_text(token_id, chosen, decode),
                logprob=max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                top=[(_token_text(t, lp, decode), max(lp.logprob, -9999.0)) for t, lp in ranked],
            )
        )
    return out


def _token_text(token_id: int, logprob: Logprob | None, decode: Callable[[int], str]) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` when the prefix cache's share is known."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def truncated(prompt: list[int], keep: int | None) -> list[int]:
    """The last ``keep`` prompt tokens (``truncate_prompt_tokens``), or the whole prompt."""
    return prompt if keep is None or keep >= len(prompt) else prompt[len(prompt) - keep :]


def response_id(prefix: str, request_id: str | None) -> str:
    """The response's id: built on the caller's ``request_id`` when given."""
    return f"{prefix}-{request_id}" if request_id else f"{prefix}-{uuid.uuid4().hex}"
