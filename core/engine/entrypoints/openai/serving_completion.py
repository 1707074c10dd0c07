"""POST /v1/completions: raw prompts (text or token ids, one or a batch) continued by the model."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.async_engine import EngineDeadError, RequestStream
from engine.entrypoints.openai.access_log import record_usage
from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.request_body import parse_body
from engine.entrypoints.openai.request_fields import check_extra_fields
from engine.entrypoints.openai.serving_common import (
    DeltaTracker,
    ServingContext,
    TokenLogprobs,
    abort_on_disconnect,
    add_request,
    check_prompt,
    merge_streams,
    refused_as_bad_request,
    response_id,
    sampling_params,
    sse,
    stop_hold_back,
    token_logprobs,
    truncated,
    usage,
)
from engine.entrypoints.openai.structured_fields import constraint_field
from engine.input_processor import check_prompt_chars, check_prompt_token_ids, check_text_prompt
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling.params import SamplingParams


def _completion_logprobs(items: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    text_offset = []
    for it in items:
        text_offset.append(offset)
        offset += len(it.token)
    return {
        "tokens": [it.token for it in items],
        "token_logprobs": [it.logprob for it in items],
        "top_logprobs": [dict(it.top) for it in items],
        "text_offset": text_offset,
    }


def _text(token: int, entry: dict[int, Logprob] | None, decode: Any) -> str:
    found = entry.get(token) if entry is not None else None
    return found.decoded_token if found is not None and found.decoded_token is not None else decode(token)


def _joined(prompt: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """The echoed prompt's logprobs followed by the completion's (whose offsets already count the echo)."""
    return {key: prompt[key] + completion[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _prompt_logprobs_field(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """``prompt_logprobs`` as vLLM's completions answer it: per prompt token, token id -> logprob, rank
    and decoded token (None for the first)."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entry is None
        else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in entry.items()}
        for entry in output.prompt_logprobs
    ]  # fmt: skip


class CompletionHandler:
    """Serves text completions for one server."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _batch(self, req: CompletionRequest) -> list[str | list[int]]:
        """Every prompt as it was sent, after the checks that cost nothing: the number of prompts, empty
        texts, and texts whose characters alone cannot fit the context (refused before tokenizing)."""
        tokenizer = self.ctx.engine.tokenizer
        raw = req.prompt
        if isinstance(raw, str):
            batch: list[str | list[int]] = [raw]
        elif raw and all(isinstance(p, int) for p in raw):
            batch = [raw]  # type: ignore[list-item]
        else:
            batch = list(raw)  # type: ignore[arg-type]
        if not batch:
            raise bad_request("prompt must not be empty", param="prompt")
        self.ctx.limits.check_num_prompts(len(batch))
        for p in batch:
            if isinstance(p, str):
                with refused_as_bad_request():
                    check_text_prompt(p)
                    check_prompt_chars(len(p), self.ctx.engine.max_model_len, tokenizer.max_token_chars)
        return batch

    def _tokenize(self, batch: list[str | list[int]], echo: bool) -> list[tuple[list[int], str]]:
        """Every prompt as (token ids, text); run on the tokenizing threads when the batch is large."""
        tokenizer = self.ctx.engine.tokenizer
        out = []
        for p in batch:
            if isinstance(p, str):
                out.append((tokenizer.encode(p, add_special_tokens=True), p))
            else:
                with refused_as_bad_request():
                    check_prompt_token_ids(p, self.ctx.vocab_size)
                out.append((list(p), tokenizer.decode(list(p), skip_special_tokens=False) if echo else ""))
        return out

    async def __call__(self, request: Request) -> JSONResponse | StreamingResponse:
        ctx = self.ctx
        req = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        check_extra_fields(req, "/v1/completions", ctx.unknown_fields)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of sampling is not supported)", param="best_of")
        # max_tokens 0 scores the prompt only: the engine samples one token, which the response leaves out
        params = sampling_params(req, ctx, 1 if req.max_tokens == 0 else req.max_tokens, req.logprobs)
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs is not supported with stream (echo with logprobs is)", param="prompt_logprobs")
        scored = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        if scored:
            if not isinstance(params, SamplingParams):
                field = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
                raise bad_request(f"{field} with logprobs is not supported with use_beam_search", param=field)
            params = params.model_copy(update={"prompt_logprobs": max(scored)})
        constraint_param = constraint_field(req)
        batch = self._batch(req)
        prompts = await ctx.off_loop(sum(len(p) for p in batch), self._tokenize, batch, req.echo)
        if req.truncate_prompt_tokens is not None:
            # the echo shows what the model saw
            tokenizer = ctx.engine.tokenizer
            kept = [truncated(ids, req.truncate_prompt_tokens) for ids, _ in prompts]
            prompts = [
                (k, text if len(k) == len(ids) else tokenizer.decode(k, skip_special_tokens=False) if req.echo else "")
                for k, (ids, text) in zip(kept, prompts)
            ]
        for ids, _ in prompts:
            check_prompt(ids, req.max_tokens, ctx.engine.max_model_len, ctx.vocab_size, "max_tokens")
        ctx.limits.check_total_tokens(
            [len(ids) for ids, _ in prompts], req.n, req.max_tokens, ctx.engine.max_model_len, "max_tokens"
        )
        base_id = response_id("cmpl", req.request_id)
        # the engine's ids stay unique even when callers reuse a request_id
        engine_id = f"{base_id}-{uuid.uuid4().hex[:8]}" if req.request_id else base_id
        request_ids = [engine_id if len(prompts) == 1 else f"{engine_id}-{i}" for i in range(len(prompts))]
        streams: list[RequestStream] = []
        try:
            for rid, (ids, _) in zip(request_ids, prompts, strict=False):
                streams.append(await add_request(ctx, rid, ids, params, req.cache_salt, constraint_param, req.priority, req.model))
        except BaseException:
            for rid in request_ids[: len(streams)]:
                ctx.engine.abort(rid)
            raise
        call = _CompletionCall(ctx, req, base_id, request_ids, prompts)
        record_usage(request, call.num_prompt_tokens, 0)
        if req.stream:
            return StreamingResponse(call.stream(request, streams), media_type="text/event-stream")
        return JSONResponse(await call.complete(request, streams))


class _CompletionCall:
    """One completion request's response; choice ``i * n + j`` is completion ``j`` of prompt ``i``."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        response_id: str,
        request_ids: list[str],
        prompts: list[tuple[list[int], str]],
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.response_id = response_id
        self.request_ids = request_ids
        self.prompts = prompts
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        #: the ``model`` the response reports: the adapter's name under a LoRA adapter
        self.model = ctx.reported_model(req.model)

    def _decode(self, token_id: int) -> str:
        return self.ctx.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _echo(self, prompt_index: int) -> str:
        return self.prompts[prompt_index][1] if self.req.echo else ""

    def _visible(self, out: CompletionOutput) -> CompletionOutput:
        """The completion as the response shows it: nothing of the token ``max_tokens: 0`` sampled."""
        if self.req.max_tokens != 0:
            return out
        return CompletionOutput(out.index, "", [], 0.0, [] if out.logprobs is not None else None, "length" if out.finished else None)

    def _prompt_logprobs(self, output: RequestOutput) -> dict[str, Any]:
        """The echoed prompt's tokens in the completions ``logprobs`` shape (the first token has none)."""
        assert self.req.logprobs is not None
        ids, entries = output.prompt_token_ids, output.prompt_logprobs or []
        tokens, values, tops = [], [], []
        for position, token in enumerate(ids):
            entry = entries[position] if position < len(entries) else None
            tokens.append(_text(token, entry, self._decode))
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(max(entry[token].logprob, -9999.0))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: self.req.logprobs]
            tops.append({_text(t, {t: lp}, self._decode): max(lp.logprob, -9999.0) for t, lp in ranked})
        offsets, at = [], 0
        for token_text in tokens:
            offsets.append(at)
            at += len(token_text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def complete(self, request: Request, streams: list[RequestStream]) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async with abort_on_disconnect(request, self.ctx.engine, self.request_ids):
            try:
                async for i, output in merge_streams(streams):
                    finals[i] = output
            except EngineDeadError as exc:
                raise OpenAIError(503, str(exc), code="engine_unavailable") from None
        choices = []
        completion_tokens = 0
        for i in range(len(streams)):
            outs = sorted(finals[i].outputs, key=lambda o: o.index) if i in finals else []
            for out in outs:
                out = self._visible(out)
                completion_tokens += len(out.token_ids)
                prefix = self._echo(i)
                logprobs = None
                if self.req.logprobs is not None:
                    items = token_logprobs(out, 0, len(out.token_ids), self.req.logprobs, self._decode)
                    logprobs = _completion_logprobs(items, len(prefix))
                    if self.req.echo:
                        logprobs = _joined(self._prompt_logprobs(finals[i]), logprobs)
                choice = {
                    "index": i * self.req.n + out.index,
                    "text": prefix + out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason or ("abort" if streams[i].aborted else None),
                    "stop_reason": out.stop_reason,
                }
                if self.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_field(finals[i])
                if self.req.return_token_ids:
                    choice["prompt_token_ids"] = self.prompts[i][0]
                    choice["token_ids"] = list(out.token_ids)
                choices.append(choice)
        record_usage(request, self.num_prompt_tokens, completion_tokens)
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.num_prompt_tokens, completion_tokens, sum(f.num_cached_tokens for f in finals.values())),
        }

    def _chunk(self, choice: dict[str, Any] | None, with_usage_field: bool, usage_value: Any = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
        }
        if with_usage_field:
            chunk["usage"] = usage_value
        return chunk

    async def stream(self, request: Request, streams: list[RequestStream]) -> AsyncIterator[str]:
        n = self.req.n
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        hold = stop_hold_back(self.req.stop)
        total = len(streams) * n
        trackers = [DeltaTracker(hold_back=hold) for _ in range(total)]
        finished = [False] * total
        tokens = [0] * total
        offsets = [len(self._echo(i // n)) for i in range(total)]
        # with logprobs the echo waits for the prompt's logprobs, which come with the first output
        scored_echo = self.req.echo and self.req.logprobs is not None
        echoed = [not self.req.echo] * len(streams)
        async with abort_on_disconnect(request, self.ctx.engine, self.request_ids):
            for i in range(total):
                if self.req.echo and not scored_echo:
                    yield sse(self._chunk({"index": i, "text": self._echo(i // n), "logprobs": None, "finish_reason": None}, include_usage))
            try:
                async for prompt_index, output in merge_streams(streams):
                    if not echoed[prompt_index]:
                        echoed[prompt_index] = True
                        if scored_echo:
                            for index in range(prompt_index * n, prompt_index * n + n):
                                logprobs = self._prompt_logprobs(output)
                                choice = {"index": index, "text": self._echo(prompt_index), "logprobs": logprobs, "finish_reason": None}
                                yield sse(self._chunk(choice, include_usage))
                    for out in output.outputs:
                        index = prompt_index * n + out.index
                        if out.index >= n or finished[index]:
                            continue
                        out = self._visible(out)
                        tokens[index] = len(out.token_ids)
                        record_usage(request, self.num_prompt_tokens, sum(tokens))
                        for choice in self._delta_choices(out, index, trackers[index], offsets):
                            yield sse(self._chunk(choice, include_usage))
                        finished[index] = out.finished
            except EngineDeadError as exc:
                yield sse(OpenAIError(503, str(exc), code="engine_unavailable").body())
                yield sse("[DONE]")
                return
            for index in range(total):
                if not finished[index]:
                    yield sse(self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}, include_usage))
            if include_usage:
                yield sse(self._chunk(None, True, usage(self.num_prompt_tokens, sum(tokens))))
            yield sse("[DONE]")

    def _delta_choices(
        self, out: CompletionOutput, index: int, tracker: DeltaTracker, offsets: list[int]
    ) -> list[dict[str, Any]]:
        text = tracker.next_text(out)
        start, end = tracker.next_tokens(out)
        logprobs = None
        if self.req.logprobs is not None and end > start:
            items = token_logprobs(out, start, end, self.req.logprobs, self._decode)
            logprobs = _completion_logprobs(items, offsets[index])
            offsets[index] += sum(len(it.token) for it in items)
        choices = []
        if text or logprobs is not None:
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})
        if out.finished:
            choices.append({"index": index, "text": "", "logprobs": None, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return choices
