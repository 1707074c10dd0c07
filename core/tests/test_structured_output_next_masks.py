"""A step's masks started on the backend's threads as soon as the step before is accepted: they equal masks
filled at once, whatever the next step's rows (same order, reordered, some new, some released), and a
step's advance reports exactly the rows that refused or ended (xgrammar's one batch call)."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from engine.interfaces.ops import unpack_token_bitmask
from engine.structured_output import StructuredOutputManager, StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")
VOCAB = 49152
#: enough rows for the backend to fill them in the background (``BATCH_FILL_MIN_ROWS``)
ROWS = 24
KINDS = (
    {"regex": r"[a-z]{1,6}-[0-9]{2,4}"},
    {"choice": ["alpha", "beta", "gamma delta"]},
    {"json": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}},
)


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf_path):
    from engine.loader import load_tokenizer

    return load_tokenizer(smollm_gguf_path)


@pytest.fixture
def manager(tokenizer):
    from engine.structured_output.xgrammar_backend import XgrammarBackend

    backend = XgrammarBackend(tokenizer.hf, VOCAB, tokenizer.eos_token_ids, fill_threads=3)
    manager = StructuredOutputManager(lambda: backend)
    yield manager
    manager.shutdown()


def start(manager, seq_ids):
    seqs = []
    for i in seq_ids:
        params = StructuredOutputsParams(**KINDS[i % len(KINDS)])
        constraint = SimpleNamespace(structured_outputs=params)
        seq = SimpleNamespace(seq_id=i, params=constraint, output_token_ids=[])
        manager.start([seq], manager.compile(params).result())
        seqs.append(seq)
    return seqs


def filled_now(manager, targets) -> torch.Tensor:
    """Each constrained row filled from its matcher on this thread, one by one (the reference)."""
    bitmask = manager.backend.allocate_bitmask(len(targets))
    for i, seq in enumerate(targets):
        matcher = manager._matchers.get(seq.seq_id)
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


def check(manager, targets) -> torch.Tensor:
    bitmask, rows = manager.fill_bitmask(targets)
    want = filled_now(manager, targets)
    assert rows == [i for i, s in enumerate(targets) if manager.constrains(s)]
    assert torch.equal(bitmask, want)
    return bitmask


def step(manager, seqs, rng, bitmask) -> set[int]:
    """Each sequence takes an allowed token (never its stop token, so that it keeps going)."""
    eos = set(manager.backend._stop_token_ids)
    allowed = unpack_token_bitmask(bitmask, VOCAB)
    for i, seq in enumerate(seqs):
        ids = [t for t in allowed[i].nonzero().flatten().tolist() if t not in eos]
        seq.output_token_ids.append(rng.choice(ids) if ids else next(iter(eos)))
    return manager.accept_step(seqs)


def test_started_masks_equal_masks_filled_now(manager):
    """Steady steps take the started bitmask itself; reordered rows, a new row and a released row take
    their rows from it or fill them now, and every row equals a fill at once."""
    rng = random.Random(0)
    seqs = start(manager, range(ROWS))
    bitmask = check(manager, seqs)  # the first step: nothing started yet
    finished = 0
    for n in range(6):
        ended = step(manager, seqs, rng, bitmask)
        finished += len(ended)
        started = manager._next
        assert started is not None and started.seqs == seqs
        manager.release([s for s in seqs if s.seq_id in ended])
        if n % 3 == 0:
            # the next step's rows are this step's, as the engine schedules them before it accepts (the
            # ended ones released since): the started bitmask itself
            got = check(manager, seqs)
            assert got is started.bitmask
            keep = [i for i, s in enumerate(seqs) if s.seq_id not in ended]
            seqs, bitmask = [seqs[i] for i in keep], got[keep]
            continue
        seqs = [s for s in seqs if s.seq_id not in ended]
        if n % 3 == 1:
            # the scheduler reordered the rows and a new sequence joined: rows copied, the new one filled
            order = seqs[::-1] + start(manager, [1000 + n])
            check(manager, order)
            seqs = order
            bitmask = check(manager, seqs)  # nothing started now: every row filled at once
        else:
            # a sequence finished meanwhile (released): its row allows every token
            gone = seqs.pop(3)
            manager.release([gone])
            got, rows = manager.fill_bitmask([*seqs[:3], gone, *seqs[3:]])
            assert 3 not in rows and (got[3] == -1).all()
            assert torch.equal(got[[i for i in range(len(seqs) + 1) if i != 3]], filled_now(manager, seqs))
            bitmask = check(manager, seqs)
    assert finished  # some grammars ended (their rows are not filled: a terminated matcher has none)
    manager.release(seqs)
    assert manager.num_matchers == 0


def test_a_step_reports_the_rows_that_refuse_or_end(manager, tokenizer, caplog):
    """At a batch filled in the background: the row whose token its grammar refuses and the row whose stop
    token ends its grammar are the ones ended; the others go on (and their next masks are started)."""
    eos = tokenizer.eos_token_ids[0]
    seqs = start(manager, [3 * i + 1 for i in range(ROWS)])  # every one a choice of three words
    refused = tokenizer.encode("{", add_special_tokens=False)[0]
    beta = tokenizer.encode("beta", add_special_tokens=False)
    done = seqs[5]
    for token in beta:
        done.output_token_ids.append(token)
        assert not manager.accept(done, token)
    for i, seq in enumerate(seqs):
        seq.output_token_ids.append(refused if i == 2 else eos if i == 5 else beta[0])
    with caplog.at_level(logging.WARNING):
        ended = manager.accept_step(seqs)
    assert ended == {seqs[2].seq_id, seqs[5].seq_id}
    assert "which its grammar refuses" in caplog.text
    going = [s for i, s in enumerate(seqs) if i not in (2, 5)]
    assert manager._next is not None and manager._next.seqs == seqs
    manager.release([seqs[2], seqs[5]])
    check(manager, going)


def test_pinned_bitmasks_fall_back_to_pageable_memory(tokenizer, caplog):
    """Asked for pinned bitmasks where torch cannot pin (no accelerator here), the manager warns once and
    goes on with pageable ones."""
    from engine.structured_output.xgrammar_backend import XgrammarBackend

    if torch.accelerator.is_available():
        pytest.skip("this machine can pin memory")
    backend = XgrammarBackend(tokenizer.hf, VOCAB, tokenizer.eos_token_ids)
    manager = StructuredOutputManager(lambda: backend, pin_memory=True)
    seqs = start(manager, range(ROWS))
    with caplog.at_level(logging.WARNING):
        check(manager, seqs)
        check(manager, seqs)
    assert caplog.text.count("pageable memory") == 1
    manager.shutdown()
