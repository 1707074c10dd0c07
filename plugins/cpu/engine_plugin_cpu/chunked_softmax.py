"""Attention over one chunk of keys, and the log-sum-exp merge that joins chunks into one softmax.

Shapes follow torch SDPA: ``q [B, h, R, d]``, ``k, v [B, h, T, d]``, masks ``[B, 1, R or 1, T]`` where
True means "visible". Grouped-query attention is handled by the caller folding each KV head's query
heads into the row axis, so ``h`` here is always the number of KV heads.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def flash_with_lse_available() -> bool:
    """Whether torch exposes its CPU flash-attention kernel that also returns the log-sum-exp.

    The op is private to torch; when a future torch drops it, the matmul path takes over.
    """
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the ``0 / -inf`` float mask torch's flash kernel wants."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, NEG_INF)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Softmax attention when every key is in this one chunk; output in ``q``'s dtype.

    Every row must see at least one key (true for a whole context: a token sees itself).
    """
    if soft_cap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out, _ = attend_matmul(q, k, v, mask, scale, soft_cap)
    return out.to(q.dtype)


def attend_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    additive: torch.Tensor | None,
    has_visible: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
    use_flash: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one chunk of a longer context, with the chunk's log-sum-exp for merging.

    Args:
        q, k, v: see the module docstring.
        mask: boolean visibility ``[B, 1, R or 1, T]`` or None when all keys are visible.
        additive: the same mask as ``0 / -inf`` in ``q``'s dtype (for the flash kernel), or None.
        has_visible: ``[B, 1, R or 1]``, False for rows that see no key of this chunk; None if all do.
        scale: softmax scale.
        soft_cap: ``cap * tanh(s / cap)`` on the scores when set.
        use_flash: use torch's CPU flash kernel (ignored when ``soft_cap`` is set: it has no cap).

    Returns:
        ``(out [B, h, R, d], lse [B, h, R])``, both float32; rows that see nothing have ``lse = -inf``.
    """
    if use_flash and soft_cap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=additive, scale=scale
        )
        if has_visible is not None:
            # the kernel reports lse 0 (not -inf) for a row with no visible key, which would give it weight
            lse = lse.masked_fill(~has_visible, NEG_INF)
        return out.float(), lse
    return attend_matmul(q, k, v, mask, scale, soft_cap)


def attend_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain matmul-softmax-matmul in float32; returns ``(out, lse)`` as :func:`attend_with_lse`."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if soft_cap is not None:
        scores = torch.tanh(scores.div_(soft_cap)).mul_(soft_cap)
    if mask is not None:
        scores.masked_fill_(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    # a row that sees nothing has lse -inf; subtracting 0 instead keeps its weights at exp(-inf) = 0
    safe_lse = lse.masked_fill(lse == NEG_INF, 0.0)
    probs = torch.exp(scores.sub_(safe_lse.unsqueeze(-1)))
    return torch.matmul(probs, v.float()), lse


def merge_chunk(
    acc: torch.Tensor | None,
    acc_lse: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one chunk's normalised output into the running one (online softmax across chunks).

    Each input is normalised over its own keys; weighting by ``exp(lse_part - lse_total)`` renormalises
    both over the union.

    Returns:
        The new ``(acc, acc_lse)``.
    """
    if acc is None or acc_lse is None:
        return out, lse
    total = torch.logaddexp(acc_lse, lse)
    safe_total = total.masked_fill(total == NEG_INF, 0.0)
    w_acc = torch.exp(acc_lse - safe_total).unsqueeze(-1)
    w_new = torch.exp(lse - safe_total).unsqueeze(-1)
    return acc.mul_(w_acc).add_(out * w_new), total
