"""A constraint held back while the model thinks (``ReasoningGate``): the manager's phases, on a fake
backend whose grammar allows only token 7 then ends."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.interfaces.ops import unpack_token_bitmask
from engine.structured_output import StructuredOutputManager
from engine.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from engine.structured_output.params import ReasoningGate, StructuredOutputsParams

VOCAB = 64
GRAMMAR_TOKEN, START, END = 7, 40, 41


class _Matcher(GrammarMatcher):
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id != GRAMMAR_TOKEN or self.accepted:
            return False
        self.accepted.append(token_id)
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, GRAMMAR_TOKEN // 32] = 1 << (GRAMMAR_TOKEN % 32)

    def is_terminated(self) -> bool:
        return bool(self.accepted)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def reset(self) -> None:
        self.accepted.clear()


class _Backend(StructuredOutputBackend):
    vocab_size = VOCAB

    def parse(self, spec):
        return spec

    def compile(self, grammar):
        return grammar

    def make_matcher(self, compiled) -> _Matcher:
        return _Matcher()


def _seq(seq_id: int, gate: ReasoningGate | None):
    params = SimpleNamespace(structured_outputs=StructuredOutputsParams(regex="x", reasoning_gate=gate))
    return SimpleNamespace(seq_id=seq_id, params=params, output_token_ids=[])


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return set(unpack_token_bitmask(bitmask[row : row + 1], VOCAB)[0].nonzero().flatten().tolist())


def _step(manager: StructuredOutputManager, seq, token: int) -> bool:
    seq.output_token_ids.append(token)
    return manager.accept(seq, token)


def test_thinking_is_free_then_the_grammar_holds():
    manager = StructuredOutputManager(_Backend)
    seq = _seq(1, ReasoningGate(lambda ids: END in ids))
    manager.start([seq], object())
    assert manager.constrains(seq) and manager.num_matchers == 1
    bitmask, rows = manager.fill_bitmask([seq])
    assert rows == [0] and len(_allowed(bitmask, 0)) == VOCAB  # a mask (no device overlap), all allowed
    assert not _step(manager, seq, 3)
    assert not _step(manager, seq, END)  # the thinking ends; this token is not the grammar's
    bitmask, _ = manager.fill_bitmask([seq])
    assert _allowed(bitmask, 0) == {GRAMMAR_TOKEN}
    assert _step(manager, seq, GRAMMAR_TOKEN)  # the grammar's stop
    manager.release([seq])
    assert manager.num_matchers == 0


def test_optional_start_marker_answers_at_once_or_thinks():
    manager = StructuredOutputManager(_Backend)
    gate = ReasoningGate(lambda ids: ids[0] != START or END in ids[1:], optional_start_token=START)
    answers, thinks = _seq(1, gate), _seq(2, gate)
    manager.start([answers, thinks], object())
    bitmask, rows = manager.fill_bitmask([answers, thinks])
    assert rows == [0, 1]
    assert _allowed(bitmask, 0) == _allowed(bitmask, 1) == {GRAMMAR_TOKEN, START}
    assert _step(manager, answers, GRAMMAR_TOKEN)  # fed to the grammar, which it ends
    assert not _step(manager, thinks, START)
    assert len(_allowed(manager.fill_bitmask([thinks])[0], 0)) == VOCAB
    assert not _step(manager, thinks, END)
    assert _allowed(manager.fill_bitmask([thinks])[0], 0) == {GRAMMAR_TOKEN}
    manager.release([answers, thinks])
    assert manager.num_matchers == 0
