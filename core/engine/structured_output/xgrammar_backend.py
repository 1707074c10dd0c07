"""The structured-output backend on xgrammar: a tokenizer's vocabulary compiled once, grammars on top."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from engine.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from engine.structured_output.params import GrammarSpec

#: JSON without spaces after separators: compact answers end within a sensible number of tokens
COMPACT_SEPARATORS = (",", ":")


#: rows from which a step's bitmask is filled on several threads
BATCH_FILL_MIN_ROWS = 16


class XgrammarMatcher(GrammarMatcher):
    """An ``xgrammar.GrammarMatcher``; rollback is unbounded (a sequence may undo any of its tokens)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

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

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows in shards on threads of ours; a few rows (where threads cost more than they save) in turn.

        xgrammar's own batch fill measured no faster than one row after another (on 2 and on 16 cores),
        but it releases the GIL, so shards filled by separate calls on separate threads do run together.
        """
        if len(matchers) < BATCH_FILL_MIN_ROWS or self._fill_shards == 1:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        inner = _inner(matchers)
        shards = min(self._fill_shards, len(inner) // (BATCH_FILL_MIN_ROWS // 2))
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(self._fill_shards - 1, thread_name_prefix="grammar-fill-shard")
            self._fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self._fill_shards)]

        def fill(k: int) -> None:
            self._fillers[k].batch_fill_next_token_bitmask(inner[k::shards], bitmask, rows[k::shards])

        futures = [self._fill_pool.submit(fill, k) for k in range(1, shards)]
        fill(0)
        for future in futures:
            future.result()

    def advance(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[tuple[bool, bool]]:
        """One call into xgrammar for the whole step; a matcher can only be terminated by a stop token
        (matchers are built to wait for one), so only those rows ask."""
        inner = _inner(matchers)
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(inner, token_ids)
        stops = self._stop_token_ids
        return [
            (ok, ok and token in stops and matcher.is_terminated())
            for ok, token, matcher in zip(accepted, token_ids, inner, strict=True)
        ]

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
