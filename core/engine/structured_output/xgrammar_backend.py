"""The structured-output backend on xgrammar: a tokenizer's vocabulary compiled once, grammars on top."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import Any

import torch
import xgrammar as xgr

from engine.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from engine.structured_output.params import GrammarSpec

#: JSON without spaces after separators: compact answers end within a sensible number of tokens
COMPACT_SEPARATORS = (",", ":")


#: rows from which a step's bitmask is filled on several threads
BATCH_FILL_MIN_ROWS = 16

# A step's calls go to xgrammar's native objects (``_handle``) where this xgrammar has the tvm-ffi
# bindings these calls were measured with (0.2.9; the nanobind ones before differ). Its public
# ``BatchGrammarMatcher.batch_accept_token`` turns its result into a list of bools one FFI call per row:
# at batch 256 that took longer (150 us on a 2-core EPYC) than advancing the matchers; the native call
# returns an array that answers ``0 in result`` in one call. And a fill shard's thread then holds the GIL
# only to enter xgrammar (its arguments are built beforehand). The public methods are the fallback
# should a later xgrammar move any of these.
try:
    from xgrammar.base import _core as _xgr_core

    _NATIVE_BATCH_ACCEPT: Callable[..., Any] | None = _xgr_core.BatchGrammarMatcher.batch_accept_token
except (ImportError, AttributeError):  # pragma: no cover - another xgrammar layout
    _NATIVE_BATCH_ACCEPT = None
_NATIVE = (
    _NATIVE_BATCH_ACCEPT is not None
    and _xgr_core.__name__.startswith("xgrammar.tvm_ffi_binding")
    and all(
        isinstance(getattr(c, "_handle", None), property)
        for c in (xgr.GrammarMatcher, xgr.BatchGrammarMatcher)
    )
)


class XgrammarMatcher(GrammarMatcher):
    """An ``xgrammar.GrammarMatcher``; rollback is unbounded (a sequence may undo any of its tokens)."""

    __slots__ = ("_matcher", "_native")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        #: the native matcher a step's batch calls take (None: they take the public methods)
        self._native = self._matcher._handle if _NATIVE else None

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(_fill_target(bitmask), row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"cannot roll back {num_tokens} tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """xgrammar over one model's tokenizer.

    Args:
        hf_tokenizer: the engine tokenizer's Hugging Face tokenizer (a GGUF's is built from its metadata).
        vocab_size: the model's vocabulary (its logits columns without padding). The bitmask covers only
            the ids the tokenizer has (an embedding is often padded past them): columns past a bitmask's
            words are never allowed, and xgrammar's matchers, which treat every id the tokenizer lacks
            as a special token, advanced about 10x slower over Llama-3's 128,256 columns with a 49,152-id
            tokenizer.
        stop_token_ids: the tokens that end a sequence (EOS and the model's extra stop ids).
        max_threads: xgrammar's own threads per compilation.
        fill_threads: threads filling a step's bitmask (default: the usable cores but one, at most 8).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_threads: int = 2,
        fill_threads: int | None = None,
    ) -> None:
        self._vocab_size = min(vocab_size, tokenizer_size(hf_tokenizer))
        self._stop_token_ids = frozenset(t for t in stop_token_ids if t < self._vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=self._vocab_size, stop_token_ids=sorted(self._stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        # a step's many rows fill in shards, one per core but the engine thread's (up to 8): at batch 256
        # the rows one by one took half as long as the forward they are meant to hide behind
        self._fill_shards = fill_threads or max(1, min(8, _usable_cores() - 1))
        self._fill_pool: ThreadPoolExecutor | None = None
        self._fillers: list[xgr.BatchGrammarMatcher] = []
        #: the shards of the last fill started in the background (calls on one filler may not overlap)
        self._started: list[Future] = []

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def fills_in_background(self) -> bool:
        return True

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows in shards, this thread filling one; a few rows (where threads cost more than they
        save) in one call here.

        xgrammar's own batch fill measured no faster than one row after another (on 2 and on 16 cores),
        but it releases the GIL, so shards filled by separate calls on separate threads do run together.
        """
        calls = self._shard_calls(matchers, bitmask, rows)
        futures = [self._pool().submit(call) for call in calls[1:]]
        calls[0]()
        for future in futures:
            future.result()

    def start_step(
        self, matchers: list[GrammarMatcher], token_ids: list[int], bitmask: torch.Tensor
    ) -> tuple[list[tuple[int, bool]], Callable[[], None]]:
        """Each shard (at least one) on the pool's threads advances its rows, then fills their masks; this
        returns once every shard has advanced. A few rows, which take less time than a thread takes to
        start, go here.

        A shard's thread needs the GIL to enter xgrammar and to leave it, not in between. This thread
        waiting for the shards to advance hands them the GIL now: otherwise a shard may wait for it
        behind this thread's Python work for a whole switch interval (5 ms), which is how an earlier
        fill on a worker thread lost to the fill on the engine's thread. The fill that follows needs
        the GIL only to start and to end.
        """
        if len(matchers) < BATCH_FILL_MIN_ROWS:
            return super().start_step(matchers, token_ids, bitmask)
        fills = self._shard_calls(matchers, bitmask, list(range(len(matchers))))
        shards = len(fills)
        ended: list[list[tuple[int, bool]]] = [[] for _ in fills]
        failed: list[Exception] = []
        advanced = threading.Semaphore(0)

        def run(k: int) -> None:
            try:
                own = self.advance_step(matchers[k::shards], token_ids[k::shards])
                # this shard's rows are k, k + shards, ...: its indices map back by that stride
                ended[k] = [(k + shards * i, ok) for i, ok in own]
            except Exception as exc:  # re-raised on the caller's thread
                failed.append(exc)
                return
            finally:
                advanced.release()
            terminated = {i for i, ok in own if ok}
            # a terminated matcher has no next token: xgrammar refuses to fill its row
            (_without(fills[k], terminated) if terminated else fills[k])()

        futures = self._started = [self._pool().submit(run, k) for k in range(shards)]
        for _ in range(shards):
            advanced.acquire()
        if failed:
            raise failed[0]

        def wait() -> None:
            for future in futures:
                future.result()

        return sorted(e for part in ended for e in part), wait

    def _shard_calls(
        self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> list[Callable[[], None]]:
        """One ready call per shard (every ``shards``-th row), its arguments built on this thread, once the
        fill started before has ended (its caller sees its error, if any, from its own wait)."""
        wait_futures(self._started)
        target = _fill_target(bitmask)
        shards = max(1, min(self._fill_shards, len(matchers) // (BATCH_FILL_MIN_ROWS // 2)))
        if not self._fillers:
            # one batch matcher per shard: calls on one may not overlap
            self._fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self._fill_shards)]
        native = _natives(matchers)
        if native is not None:
            return [
                partial(self._fillers[k]._handle.batch_fill_next_token_bitmask, native[k::shards], target, rows[k::shards], False)
                for k in range(shards)
            ]  # fmt: skip
        inner = _inner(matchers)
        return [
            partial(self._fillers[k].batch_fill_next_token_bitmask, inner[k::shards], target, rows[k::shards])
            for k in range(shards)
        ]

    def _pool(self) -> ThreadPoolExecutor:
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(self._fill_shards, thread_name_prefix="grammar-fill-shard")
        return self._fill_pool

    def advance(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[tuple[bool, bool]]:
        ended = dict(self.advance_step(matchers, token_ids))
        return [(ended.get(i, True), ended.get(i, False)) for i in range(len(matchers))]

    def advance_step(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[tuple[int, bool]]:
        """One call into xgrammar for the whole step, and per-row Python only for rows that may end: a
        refused token (which the mask should make impossible), or a stop token (matchers are built to
        wait for one, so nothing else can terminate them)."""
        accepted = _batch_accept(matchers, token_ids)
        stops = self._stop_token_ids
        refused = 0 in accepted or False in accepted  # one native call each on xgrammar's array
        if not refused and stops.isdisjoint(token_ids):
            return []
        inner = _inner(matchers)
        ended = []
        for i, token in enumerate(token_ids):
            if refused and not accepted[i]:
                ended.append((i, False))
            elif token in stops and inner[i].is_terminated():
                ended.append((i, True))
        return ended

    def parse(self, spec: GrammarSpec) -> xgr.Grammar:
        try:
            return self._parse(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {_first_line(exc)}") from None

    def _parse(self, spec: GrammarSpec) -> xgr.Grammar:
        json_style: dict[str, Any] = (
            {"any_whitespace": False, "separators": COMPACT_SEPARATORS}
            if spec.compact_json
            else {"any_whitespace": True}
        )
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.text, **json_style)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **json_style)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            # JSON string literals are EBNF string literals (the same escapes)
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
        raise ValueError(f"unknown constraint kind {spec.kind!r}")

    def compile(self, grammar: object) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"the grammar does not compile: {_first_line(exc)}") from None

    def make_matcher(self, compiled: object) -> XgrammarMatcher:
        return XgrammarMatcher(compiled)  # type: ignore[arg-type]


def _without(fill: partial[None], skip: set[int]) -> partial[None]:
    """A shard's fill call (its matchers, the bitmask, their rows, ...) without the given positions."""
    matchers, target, rows, *rest = fill.args
    keep = [j for j in range(len(rows)) if j not in skip]
    return partial(fill.func, [matchers[j] for j in keep], target, [rows[j] for j in keep], *rest)


def _batch_accept(matchers: list[GrammarMatcher], token_ids: list[int]) -> Any:
    """Each matcher advanced by its token in one call; returns what says which were accepted (indexable,
    truthy per accepted row)."""
    native = _natives(matchers)
    if native is not None and _NATIVE_BATCH_ACCEPT is not None:
        return _NATIVE_BATCH_ACCEPT(native, token_ids, False)
    return xgr.BatchGrammarMatcher.batch_accept_token(_inner(matchers), token_ids)


def _natives(matchers: list[GrammarMatcher]) -> list[Any] | None:
    """The matchers' native objects (None where this xgrammar's layout is not the one known here)."""
    if not _NATIVE:
        return None
    try:
        return [m._native for m in matchers]  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError("this backend takes its own matchers only") from None


def _fill_target(bitmask: torch.Tensor) -> Any:
    """The bitmask as xgrammar fills it: a numpy view, which says "CPU" through DLPack where a pinned
    tensor (the manager's bitmasks on an accelerator) says "CUDA host", which xgrammar may refuse."""
    return bitmask.numpy()


def _inner(matchers: list[GrammarMatcher]) -> list[xgr.GrammarMatcher]:
    inner = [m._matcher for m in matchers if isinstance(m, XgrammarMatcher)]
    if len(inner) != len(matchers):
        raise TypeError("this backend takes its own matchers only")
    return inner


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def tokenizer_size(hf_tokenizer: Any) -> int:
    """One past the largest id the tokenizer has (its added tokens included)."""
    return max(hf_tokenizer.get_vocab().values()) + 1


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:123: ``) and trailing dump."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text.startswith("/") or ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text
