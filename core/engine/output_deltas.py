"""Request outputs as deltas, for the pipe between an engine-core process and the server's process.

:meth:`LLMEngine.step <engine.llm_engine.LLMEngine.step>` returns cumulative outputs: each carries every
token and the whole text so far. Pickling those across a process boundary costs time quadratic in a
request's length, paid by the engine core's step loop. :class:`OutputDeltaEncoder` (in the core's process)
sends each request's prompt once and then only what changed since its previous output;
:class:`OutputDeltaDecoder` (in the server's process) rebuilds the same cumulative
:class:`~engine.outputs.RequestOutput` objects. Pooling outputs are sent whole (they come once).

Outputs only grow in the common case, but a finished text may end shorter than what was shown (a stop
string cut off) and beam search replaces its hypotheses, so every sequence field travels as
``(kept, tail)``: keep the first ``kept`` items of the previous value, then append ``tail``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import CompletionOutput, Logprob, RequestOutput

#: one completion's change: index, (text kept, text tail), (ids kept, ids tail), cumulative logprob,
#: (logprob entries kept, tail) or None, finish reason, stop reason
CompletionDelta = tuple[
    int, int, str, int, list[int], "float | None", "tuple[int, list[dict[int, Logprob]]] | None", "str | None",
    "str | int | None",
]


@dataclass(slots=True)
class OutputDelta:
    """One request's change in one step.

    Attributes:
        request_id: the caller's id.
        finished: whether every completion is done.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        completions: per completion, see :data:`CompletionDelta`.
        prompt: ``(prompt text, prompt token ids)`` in a request's first delta only, else None.
        prompt_logprobs: ``(kept, tail)`` of the prompt's logprob entries, None when the request has none.
    """

    request_id: str
    finished: bool
    num_cached_tokens: int
    completions: list[CompletionDelta]
    prompt: tuple[str | None, list[int]] | None = None
    prompt_logprobs: tuple[int, list[dict[int, Logprob] | None]] | None = None


def _kept_prefix(previous: list[Any] | str, current: list[Any] | str) -> int:
    """How much of ``previous`` starts ``current`` unchanged: all of it in the common, growing case."""
    n = len(previous)
    if len(current) >= n and current[:n] == previous:
        return n
    k = 0
    for a, b in zip(previous, current):
        if a != b:
            break
        k += 1
    return k


def _kept_entries(previous: list[Any], current: list[Any]) -> int:
    """Like :func:`_kept_prefix` for logprob entries, compared by identity: the engine appends the same
    dict objects to each output, and equal entries re-sent cost only their size."""
    n = min(len(previous), len(current))
    k = 0
    while k < n and current[k] is previous[k]:
        k += 1
    return k


class OutputDeltaEncoder:
    """The engine core's side: remembers each request's last output and encodes the next as a delta."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def encode(self, output: Any) -> Any:
        """An :class:`OutputDelta` for a generation output; any other output (pooling) as it is.

        A finished request is forgotten once encoded.
        """
        if not isinstance(output, RequestOutput):
            return output
        previous = self._last.pop(output.request_id, None)
        if not output.finished:
            self._last[output.request_id] = output
        old = previous.outputs if previous is not None else []
        completions: list[CompletionDelta] = []
        for i, c in enumerate(output.outputs):
            p = old[i] if i < len(old) else None
            text_kept = _kept_prefix(p.text, c.text) if p is not None else 0
            ids_kept = _kept_prefix(p.token_ids, c.token_ids) if p is not None else 0
            logprobs = None
            if c.logprobs is not None:
                lp_kept = _kept_entries(p.logprobs, c.logprobs) if p is not None and p.logprobs is not None else 0
                logprobs = (lp_kept, c.logprobs[lp_kept:])
            completions.append((
                c.index, text_kept, c.text[text_kept:], ids_kept, c.token_ids[ids_kept:], c.cumulative_logprob,
                logprobs, c.finish_reason, c.stop_reason,
            ))  # fmt: skip
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            before = previous.prompt_logprobs if previous is not None else None
            kept = _kept_entries(before, output.prompt_logprobs) if before is not None else 0
            prompt_logprobs = (kept, output.prompt_logprobs[kept:])
        return OutputDelta(
            request_id=output.request_id,
            finished=output.finished,
            num_cached_tokens=output.num_cached_tokens,
            completions=completions,
            prompt=(output.prompt, output.prompt_token_ids) if previous is None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Drop aborted requests' state."""
        for rid in request_ids:
            self._last.pop(rid, None)


class OutputDeltaDecoder:
    """The server's side: rebuilds each request's cumulative output from its deltas."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, delta: Any) -> Any:
        """The output a delta describes (a new object each time); anything else (pooling) as it is.

        Raises:
            KeyError: a follow-up delta for a request this decoder has not seen (or forgot).
        """
        if not isinstance(delta, OutputDelta):
            return delta
        previous = self._last.pop(delta.request_id, None)
        if delta.prompt is not None:
            prompt, prompt_token_ids = delta.prompt
        elif previous is not None:
            prompt, prompt_token_ids = previous.prompt, previous.prompt_token_ids
        else:
            raise KeyError(delta.request_id)
        old = previous.outputs if previous is not None else []
        completions = []
        for i, (index, t_kept, t_tail, i_kept, i_tail, cum, logprobs, finish, stop) in enumerate(delta.completions):
            p = old[i] if i < len(old) else None
            entries = None
            if logprobs is not None:
                kept, tail = logprobs
                entries = (p.logprobs[:kept] if p is not None and p.logprobs is not None else []) + tail
            completions.append(CompletionOutput(
                index=index,
                text=(p.text[:t_kept] if p is not None else "") + t_tail,
                token_ids=(p.token_ids[:i_kept] if p is not None else []) + i_tail,
                cumulative_logprob=cum,
                logprobs=entries,
                finish_reason=finish,
                stop_reason=stop,
            ))  # fmt: skip
        prompt_logprobs = None
        if delta.prompt_logprobs is not None:
            kept, tail = delta.prompt_logprobs
            before = previous.prompt_logprobs if previous is not None else None
            prompt_logprobs = (before[:kept] if before is not None else []) + tail
        output = RequestOutput(
            request_id=delta.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=completions,
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
        if not delta.finished:
            self._last[delta.request_id] = output
        return output

    def forget(self, request_id: str) -> None:
        """Drop an aborted request's state (unknown ids are ignored)."""
        self._last.pop(request_id, None)


__all__ = ["OutputDelta", "OutputDeltaDecoder", "OutputDeltaEncoder"]
