"""Mixture-of-experts routing: each token's ``top_k`` experts and their weights from its router logits, one
program a token (:func:`moe_topk_kernel`).

At batch 1 this kernel sits between the router GEMV and the experts' GEMVs, so its latency is a step's: one
program, one warp for up to 128 experts, its time the chain of cross-lane reductions it waits on. Each pick is
one maximum over 64-bit keys that pack a value's ordered bits over its inverted index (the larger value wins,
the lower index on ties): five shuffle rounds a pick, where a maximum then an arg-min over the equal values took
ten one after the other. That form (``LOGIT_PICKS``) serves softmax routing without a bias or groups: it picks by
the logits themselves (the softmax keeps their order) and takes the weights from the picked logits (over their own
sum when renormalised), so no pass over every expert's score waits ahead of the picks. Grouped and biased routing
(DeepSeek's) keeps three reductions a pick: a maximum, the lowest index holding it, and its score.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin

#: :func:`_keys` of -inf (bits 0xFF800000, ordered 0x807FFFFF) with an index part of 0
GONE_KEY = tl.constexpr(-0x7F800001 << 32)


@triton.jit
def _keys(value, idx, BIG: tl.constexpr):
    """int64 keys ordered as ``value`` (float32, no NaN), the lower ``idx`` first among equal values."""
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (BIG - idx).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 value a key of :func:`_keys` holds."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def moe_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling,
    NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr, G_P2: tl.constexpr, S_P2: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, GROUP_MAX: tl.constexpr, LOGIT_PICKS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One token per program, its experts as a ``[groups, group size]`` tile: scores (softmax or sigmoid),
    the correction bias added to choose, the best ``TOPK_GROUPS`` groups (by the sum of their two best
    choices, or their best with ``GROUP_MAX``) kept, then the ``TOP_K`` best choices (first index on ties) weighted
    by their scores. ``LOGIT_PICKS`` (softmax, no bias, one group): the picks by the logits and the weights from
    the picked ones.

    A NaN choice counts as -inf, and each pick is taken from the valid experts not picked yet: a row of NaN logits
    still names ``TOP_K`` distinct experts in range (NaN weights), where a stray id would send the expert kernels
    reading past the experts' weights."""
    pdl_begin(USE_PDL)  # everything it reads, the router's logits, comes from the kernel before
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, G_P2)
    offs_s = tl.arange(0, S_P2)
    idx = offs_g[:, None] * GROUP + offs_s[None, :]
    valid = (offs_g[:, None] < NUM_GROUPS) & (offs_s[None, :] < GROUP)
    x = tl.load(logits_ptr + t * stride_l + idx, mask=valid, other=float("-inf")).to(tl.float32)
    if LOGIT_PICKS:
        score = x
    elif SIGMOID:
        score = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        p = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        score = p / tl.sum(tl.sum(p, axis=1), axis=0)
    choice = score
    if HAS_BIAS:
        choice += tl.load(bias_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    if NUM_GROUPS > 1:
        best1 = tl.max(choice, axis=1)
        if GROUP_MAX:
            group_score = tl.where(offs_g < NUM_GROUPS, best1, float("-inf"))
        else:
            arg1 = tl.min(tl.where(choice == best1[:, None], offs_s[None, :], S_P2), axis=1)
            best2 = tl.max(tl.where(offs_s[None, :] == arg1[:, None], float("-inf"), choice), axis=1)
            group_score = tl.where(offs_g < NUM_GROUPS, best1 + best2, float("-inf"))
        kept = offs_g < 0
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_score, axis=0)
            g = tl.min(tl.where(group_score == top, offs_g, G_P2), axis=0)
            kept = kept | (offs_g == g)
            group_score = tl.where(offs_g == g, float("-inf"), group_score)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    offs_k = tl.arange(0, K_P2)
    chosen_w = tl.zeros([K_P2], dtype=tl.float32)
    chosen_i = tl.zeros([K_P2], dtype=tl.int64)
    big: tl.constexpr = G_P2 * S_P2
    if LOGIT_PICKS:
        # an expert out of the race: -inf's key with an index part of 0, below every valid one (-inf included)
        gone = tl.full([G_P2, S_P2], GONE_KEY, tl.int64)
        keys = tl.where(valid, _keys(choice, idx, big), gone)
        for j in tl.static_range(TOP_K):
            top = tl.max(tl.max(keys, axis=1), axis=0)
            e = big - (top & 0xFFFFFFFF)
            chosen_w = tl.where(offs_k == j, _key_value(top), chosen_w)
            chosen_i = tl.where(offs_k == j, e, chosen_i)
            keys = tl.where(idx == e, gone, keys)
        # softmax weights: exp against the best logit, over the picked ones' sum (renormalised) or every expert's;
        # a NaN logit makes them all NaN, as the softmax over every expert would
        lead = tl.max(chosen_w, axis=0)
        p = tl.where(offs_k < TOP_K, tl.exp(chosen_w - lead), 0.0)
        if RENORM:
            nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
            chosen_w = tl.where(nan > 0, float("nan"), p / tl.sum(p, axis=0))
        else:
            chosen_w = p / tl.sum(tl.sum(tl.exp(x - lead), axis=1), axis=0)
    else:
        # a maximum, then the lowest index holding it, then its score: three reductions a pick (with 64-bit keys,
        # one, the grouped sigmoid form took 40% more instructions on sm_90)
        open_ = valid  # the valid experts not picked yet
        for j in tl.static_range(TOP_K):
            best = tl.max(tl.max(tl.where(open_, choice, float("-inf")), axis=1), axis=0)
            e = tl.min(tl.min(tl.where(open_ & (choice == best), idx, big), axis=1), axis=0)
            w = tl.sum(tl.sum(tl.where(idx == e, score, 0.0), axis=1), axis=0)
            chosen_w = tl.where(offs_k == j, w, chosen_w)
            chosen_i = tl.where(offs_k == j, e.to(tl.int64), chosen_i)
            open_ = open_ & (idx != e)
        if RENORM:
            chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    chosen_w = chosen_w * scaling
    tl.store(weights_ptr + t * TOP_K + offs_k, chosen_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, chosen_i, mask=offs_k < TOP_K)
