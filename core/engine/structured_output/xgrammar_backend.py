"""The structured-output backend on xgrammar: a tokenizer's vocabulary compiled once, grammars on top."""

from __future__ import annotations

import json
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
        vocab_size: the model's vocabulary (its logits columns without padding); ids the tokenizer lacks
            are never allowed.
        stop_token_ids: the tokens that end a sequence (EOS and the model's extra stop ids).
        max_threads: xgrammar's own threads per compilation.
    """

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2
    ) -> None:
        self._vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        # fills many rows on xgrammar's own threads (one per core): at batch 256 over a 128k vocabulary the
        # rows one by one took longer than the forward they are meant to hide behind
        self._batch_filler: xgr.BatchGrammarMatcher | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows on xgrammar's threads; a few rows (where threads cost more than they save) in turn."""
        if len(matchers) < BATCH_FILL_MIN_ROWS:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        if self._batch_filler is None:
            self._batch_filler = xgr.BatchGrammarMatcher(max_threads="auto")
        inner = [m._matcher for m in matchers if isinstance(m, XgrammarMatcher)]
        if len(inner) != len(matchers):
            raise TypeError("fill_bitmasks takes this backend's matchers only")
        self._batch_filler.batch_fill_next_token_bitmask(inner, bitmask, rows)

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


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:123: ``) and trailing dump."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text.startswith("/") or ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text
