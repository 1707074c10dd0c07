"""The sampling distribution of a row: temperature, top-k, top-p, min-p, and one draw from it.

Top-k and top-p become one cut-off logit per row (tokens below it are dropped; tokens tied with it stay),
found from a partial top-k sort instead of a sort of the whole vocabulary: the nucleus of a peaked
distribution is a few hundred tokens at most, and a full sort is only done for rows where it is not.
Draws use the inverse CDF with one uniform number per row, so a row consumes the same randomness
whatever the vocabulary or the rest of the batch.
"""

from __future__ import annotations

import torch

from engine.host_copy import copy_to_device_async, tensor_to_device_async
from engine.sampling.params import SamplingParams

#: candidates examined first for top-p on rows without top-k; more only when their mass falls short
_TOP_P_CANDIDATES = 1024


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalised sampling probabilities after temperature, top-k, top-p and min-p.

    Top-p works on the top-k-renormalised distribution: the kept set is the most likely tokens whose
    mass before them is below ``top_p``, so at least one token always survives.

    Args:
        logits: ``[rows, vocab]`` processed logits (bias and penalties applied).
        params: one per row; none of them greedy (temperature above 0).

    Returns:
        ``[rows, vocab]`` non-negative weights with at least one positive entry per row.
    """
    device = logits.device
    vocab = logits.shape[1]
    # per-row settings cross from pinned memory: nothing here waits for the device (a step sampled on it
    # may leave its tokens in flight)
    temperatures = copy_to_device_async([p.temperature for p in params], device, torch.float32)
    scaled = logits / temperatures.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        cutoff = _cutoff_logits(scaled, top_k, top_p)
        scaled = scaled.masked_fill(scaled < cutoff.unsqueeze(1), float("-inf"))
    probs = scaled.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = probs.max(dim=-1, keepdim=True).values * copy_to_device_async(min_p, device, torch.float32).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _cutoff_logits(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row, the smallest logit top-k and top-p keep (-inf where the row keeps everything)."""
    vocab = scaled.shape[1]
    unbounded = [k == 0 and tp < 1.0 for k, tp in zip(top_k, top_p, strict=True)]
    width = max(top_k)
    if any(unbounded):
        width = max(width, min(vocab, _TOP_P_CANDIDATES))
    cutoff = _cutoff_from_candidates(scaled, top_k, top_p, width)
    if width < vocab and any(unbounded):
        # Rows whose nucleus did not fit the candidates (flat distributions) redo it over everything.
        # one read of the device's answer for every row, not one per row
        unbounded_rows = copy_to_device_async(unbounded, cutoff.device, torch.bool)
        short = torch.nonzero(unbounded_rows & (cutoff == float("-inf"))).flatten().tolist()
        if short:
            cutoff[short] = _cutoff_from_candidates(
                scaled[short], [top_k[i] for i in short], [top_p[i] for i in short], vocab
            )
    return cutoff


def _cutoff_from_candidates(
    scaled: torch.Tensor, top_k: list[int], top_p: list[float], width: int
) -> torch.Tensor:
    """Cut-offs using the ``width`` best logits per row; -inf for a top-p row whose nucleus needs more.

    A top-p row's nucleus needs more when the candidates' mass stays below top_p; then the cut-off is
    unknown here and -inf marks it (rows without truncation also get -inf, meaning keep all).
    """
    device = scaled.device
    vocab = scaled.shape[1]
    values = scaled.topk(width, dim=-1, sorted=True).values
    positions = torch.arange(width, device=device).unsqueeze(0)
    k = copy_to_device_async([k if k else vocab for k in top_k], device).unsqueeze(1)
    in_top_k = positions < k
    # The top-k renormalised distribution: over the first k candidates, or the whole row without top-k.
    has_top_k = copy_to_device_async([bool(k) for k in top_k], device, torch.bool).unsqueeze(1)
    norm = torch.where(
        has_top_k.squeeze(1),
        torch.logsumexp(values.masked_fill(~in_top_k, float("-inf")), dim=-1),
        torch.logsumexp(scaled, dim=-1),
    ).unsqueeze(1)
    sorted_probs = (values - norm).exp().masked_fill(~in_top_k, 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    # top_p of 1 keeps everything, even where the float sum of the tail rounds past 1
    p = copy_to_device_async([tp if tp < 1.0 else float("inf") for tp in top_p], device, torch.float32).unsqueeze(1)
    keep = in_top_k & ((cumulative - sorted_probs) < p)
    keep[:, 0] = True
    kept = keep.sum(dim=-1)
    cutoff = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    truncates = copy_to_device_async([bool(k) or tp < 1.0 for k, tp in zip(top_k, top_p, strict=True)], device, torch.bool)
    cutoff = torch.where(truncates, cutoff, torch.full_like(cutoff, float("-inf")))
    if width < vocab:
        # Without top-k, a nucleus that reaches the last candidate may extend past it: unknown here.
        unfinished = ~has_top_k.squeeze(1) & (kept == width) & truncates
        cutoff = cutoff.masked_fill(unfinished, float("-inf"))
    return cutoff


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from non-negative weights, by the inverse CDF with one uniform per row.

    Args:
        probs: ``[rows, vocab]`` weights, at least one positive per row.
        generator: the randomness source (None: torch's default); CPU or the probs' device.

    Returns:
        ``[rows]`` int64 token ids on the probs' device.
    """
    rows = probs.shape[0]
    gen_device = generator.device if generator is not None else torch.device("cpu")
    uniform = torch.rand(rows, generator=generator, device=gen_device, dtype=torch.float64)
    uniform = tensor_to_device_async(uniform, probs.device) if gen_device.type == "cpu" else uniform.to(probs.device)
    # float32 sums over a 50k vocabulary drift by ~1e-5 of the total at worst: a negligible sampling bias,
    # and float64 would cost five times as much on CPU
    cdf = probs.cumsum(dim=-1)
    targets = (uniform * cdf[:, -1].double()).float().unsqueeze(1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # uniform * total can round up to total; the last token with weight is the right pick then
    overflow = tokens >= probs.shape[1]
    # on a device, asking whether any row overflowed would wait for it: the fix-up runs unconditionally
    if probs.device.type != "cpu" or bool(overflow.any()):
        last_positive = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        tokens = torch.where(overflow, last_positive, tokens)
    return tokens
