"""Log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``): which rows of a step's
hidden states predict prompt tokens, and their logprobs, ranks and top alternatives once the logits exist.

Position ``p``'s logits predict token ``p + 1``, so a prefill chunk ``[start, end)`` of a prompt of ``P``
tokens scores tokens ``start + 1 .. min(end, P - 1)``; the prompt's first token has no logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The rows of one step that score part of one sequence's prompt.

    Attributes:
        seq: the sequence whose prompt they score.
        first_row: the row (of the step's flat batch) at prompt position ``first_position``.
        first_position: the first position; it scores token ``first_position + 1``.
        count: how many consecutive positions.
    """

    seq: Sequence
    first_row: int
    first_position: int
    count: int


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens of one sequence, on the host.

    Attributes:
        seq: the sequence.
        first_token: the index (in the prompt) of the first token scored.
        logprobs: each scored token's logprob.
        ranks: each scored token's rank (1: the most likely).
        top: per scored token, the ``k`` most likely (token id, logprob) pairs.
    """

    seq: Sequence
    first_token: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


def prompt_rows(seq: Sequence, start: int, end: int, first_row: int) -> PromptRows | None:
    """The rows of a chunk ``[start, end)`` (at ``first_row`` of the step) that score ``seq``'s prompt, or
    None when its request did not ask for prompt logprobs or the chunk scores no prompt token."""
    if seq.params.prompt_logprobs is None:
        return None
    stop = min(end, len(seq.prompt_token_ids) - 1)
    if stop <= start:
        return None
    return PromptRows(seq, first_row, start, stop - start)


def score_prompt_rows(logits: torch.Tensor, rows: list[PromptRows]) -> list[PromptLogprobs]:
    """Logprobs of the prompt tokens the rows predict.

    Args:
        logits: float ``[sum of counts, vocab]``, the rows' logits in the order of ``rows``.
        rows: the step's prompt rows.

    Returns:
        One entry per :class:`PromptRows`.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    at = 0
    for r in rows:
        block = logprobs[at : at + r.count]
        at += r.count
        targets = torch.tensor(
            r.seq.prompt_token_ids[r.first_position + 1 : r.first_position + 1 + r.count], device=block.device
        )
        chosen = block.gather(1, targets.view(-1, 1))
        ranks = (block > chosen).sum(dim=1) + 1
        k = int(r.seq.params.prompt_logprobs or 0)
        top_values, top_ids = block.topk(k, dim=1) if k else (block[:, :0], block[:, :0].long())
        top_values, top_ids = top_values.cpu().tolist(), top_ids.cpu().tolist()
        out.append(
            PromptLogprobs(
                r.seq, r.first_position + 1, chosen.view(-1).cpu().tolist(), ranks.cpu().tolist(),
                [list(zip(ids, values)) for ids, values in zip(top_ids, top_values)],
            )  # fmt: skip
        )
    return out
