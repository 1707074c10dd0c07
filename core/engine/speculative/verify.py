"""Verification of one sequence's proposals against the target's logits, keeping the target's
distribution exactly: greedy rows accept a proposal while it is the argmax; random rows accept proposal
``d`` with probability ``p(d)`` (the proposer's distribution is a point mass on ``d``) and, on a rejection,
draw from ``p`` with ``d`` removed; after every proposal is accepted, one more token is drawn from the
last row (the bonus token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling.sampler import Sampler, SampleResult, SamplingRow, needs_processing
from engine.sampling.truncation import draw, truncated_probs


@dataclass(frozen=True, slots=True)
class SpecRows:
    """A decode with proposals in a step: its rows start at ``first_row`` (the last token's, then one per
    proposal)."""

    seq: Any
    first_row: int
    drafts: list[int]


@dataclass(slots=True)
class Verified:
    """What a sequence keeps of one speculative step.

    Attributes:
        result: the emitted tokens (accepted proposals, then the target's own token) with their raw
            logprobs, ranks and top logprobs, one entry per token.
        accepted: how many proposals were accepted.
        proposed: how many were checked.
    """

    result: SampleResult
    accepted: int
    proposed: int


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    row: SamplingRow,
    drafts: list[int],
    generator: torch.Generator | None,
) -> Verified:
    """Check ``drafts`` against ``logits`` (``[len(drafts) + 1, width]``: row ``j`` predicts the token
    after the sequence and ``drafts[:j]``).

    Args:
        sampler: the engine's sampler (its processing of penalties, biases and bans).
        logits: the target's logits of the step's rows of this sequence.
        row: the sequence's sampling settings and history before the step.
        drafts: the proposals.
        generator: the row's own generator, else the engine's.

    Returns:
        The tokens to append and the acceptance counts.
    """
    vocab = sampler.vocab_size
    raw = logits[:, :vocab].float()
    params = row.params
    own = row.generator if row.generator is not None else generator
    tokens: list[int] = []
    accepted = 0
    for j in range(len(drafts) + 1):
        history = SamplingRow(params, row.prompt_token_ids, row.output_token_ids + tokens, row.generator)
        scores = raw[j : j + 1]
        if needs_processing(history):
            scores = sampler.process(scores, [history])
        draft = drafts[j] if j < len(drafts) else None
        if params.greedy:
            choice = int(scores.argmax(dim=-1))
            tokens.append(choice)
            if choice != draft:
                break
            accepted += 1
            continue
        probs = truncated_probs(scores, [params])[0]
        if draft is not None and float(torch.rand((), generator=own)) < float(probs[draft]):
            tokens.append(draft)
            accepted += 1
            continue
        if draft is not None:
            # the target's distribution without the rejected proposal (max(p - q, 0) for a point mass q)
            probs = probs.clone()
            probs[draft] = 0.0
            probs = probs / probs.sum()
        tokens.append(int(draw(probs.unsqueeze(0), own)[0]))
        break
    return Verified(_result(raw[: len(tokens)], tokens, params.logprobs), accepted, len(drafts))


def verify_greedy(picks: list[int], logprobs: list[float], drafts: list[int]) -> Verified:
    """:func:`verify` for a greedy row that needs no processing and no top logprobs, from the target's
    argmax of each row and its raw logprob, picked on the device (one read for the whole step instead of
    ``[rows, vocab]`` float32 and a pass over it on the host).

    Args:
        picks: the argmax of each of the sequence's rows (``len(drafts) + 1``).
        logprobs: each pick's raw-logit logprob.
        drafts: the proposals.

    Returns:
        The tokens to append (the accepted proposals, then the target's own) and the acceptance counts.
    """
    kept = next((j for j, draft in enumerate(drafts) if picks[j] != draft), len(drafts))
    count = kept + 1
    return Verified(SampleResult(picks[:count], logprobs[:count], [1] * count, [None] * count), kept, len(drafts))


def _result(raw: torch.Tensor, tokens: list[int], num_top: int | None) -> SampleResult:
    logprobs = torch.log_softmax(raw, dim=-1)
    ids = torch.tensor(tokens).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist() if num_top is not None else [1] * len(tokens)
    top: list[list[tuple[int, float]] | None] = [None] * len(tokens)
    if num_top:
        values, indices = logprobs.topk(num_top, dim=-1)
        top = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    elif num_top == 0:
        top = [[] for _ in tokens]
    return SampleResult(tokens, chosen.squeeze(1).tolist(), ranks, top)
