"""Attention with the rotary embedding fused in (``AttentionBackend.forward_rotary``): unrotated queries and
keys in, the float64 reference's rotate-then-attend out, and the new keys cached rotated. Only backends that
set ``fuses_rotary`` run it; the core rotates for every other one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine.interfaces.attention import HeadNorm, RotaryInput
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.pytest_plugin import not_claimed
from engine_conformance.test_attention import DECODE, MIXED, PREFILL, build
from engine_plugin_sdk.problems import AttentionProblem
from engine_plugin_sdk.reference_ops import make_cos_sin_cache, ref_rms_norm, ref_rotary_embedding
from engine_plugin_sdk.tolerances import compare

#: a decode batch with GQA, one under a window and a soft-cap, a prefill, and a mixed batch
CASES = ((DECODE, {}), (DECODE, {"sliding_window": 24, "soft_cap": 2.0}), (PREFILL, {}), (MIXED, {}))
#: the head norms' epsilon (Qwen3's)
NORM_EPS = 1e-6


def new_token_positions(problem: AttentionProblem) -> torch.Tensor:
    """int64 ``[num_tokens]``: each new token's position in its sequence."""
    spans = [range(s - q, s) for q, s in zip(problem.query_lens, problem.seq_lens)]
    return torch.tensor([p for span in spans for p in span], dtype=torch.int64)


def head_norm_weights(problem: AttentionProblem, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh per-dim scales for the query and key heads, in the activations' dtype."""
    gen = torch.Generator().manual_seed(seed)
    q_w, k_w = (1.0 + 0.5 * torch.randn(2, problem.head_dim, generator=gen, dtype=torch.float64)).to(problem.dtype)
    return q_w, k_w


def rotary_problem(
    problem: AttentionProblem, norms: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[RotaryInput, AttentionProblem, torch.Tensor]:
    """The rotation (rows past the positions for odd sequences: ``table[index]``, not ``table[position]``,
    is what counts), the problem the reference sees (rotated query, rotated new keys in the histories),
    and the rotated new keys as the cache must hold them. With ``norms`` (query and key head scales) each
    head is RMS-normalised before it is rotated."""
    positions = new_token_positions(problem)
    longest = max(problem.seq_lens)
    table = make_cos_sin_cache(2 * longest, problem.head_dim)
    seq_of_token = torch.repeat_interleave(torch.arange(len(problem.query_lens)), torch.tensor(problem.query_lens))
    index = positions + (seq_of_token % 2) * longest
    query, key = problem.query.cpu(), problem.key.cpu()
    if norms is not None:
        query, key = ref_rms_norm(query, norms[0], NORM_EPS), ref_rms_norm(key, norms[1], NORM_EPS)
    q_rot, k_rot = ref_rotary_embedding(index, query, key, table)
    # the backend rounds the rotated key to the activations' dtype before caching it, as the rotary op does
    k_stored = k_rot.to(problem.dtype)
    histories, start = [], 0
    for history, q_len in zip(problem.key_history, problem.query_lens):
        new = k_stored[start : start + q_len].to(history.device)
        histories.append(torch.cat([history[: history.shape[0] - q_len], new]))
        start += q_len
    expected = dataclasses.replace(problem, query=q_rot.to(problem.device), key_history=histories)
    device = problem.device
    head_norm = None if norms is None else HeadNorm(norms[0].to(device), norms[1].to(device), NORM_EPS)
    return RotaryInput(index.to(device), table.to(device), head_norm), expected, k_stored


def cached_new_keys(backend: Any, kv_cache: torch.Tensor, problem: AttentionProblem) -> torch.Tensor | None:
    """The keys the cache holds at the new tokens' slots, None where the backend cannot gather."""
    slots = problem.metadata.slot_mapping.cpu().tolist()
    try:
        keys = [backend.gather_kv(kv_cache, [s // problem.block_size])[0][s % problem.block_size] for s in slots]
    except NotImplementedError:
        return None
    return torch.stack(keys)


@pytest.mark.capability("attention.rotary")
def test_forward_rotary(platform: Platform, caps: Capabilities, device: Any) -> None:
    """``forward_rotary`` on decode, windowed and soft-capped decode, prefill and mixed batches with GQA."""
    backend = platform.make_attention_backend()
    if not backend.fuses_rotary:
        not_claimed("the attention backend does not fuse the rotary embedding (the core rotates first)")
    check_cases(backend, caps, device, head_norm=False)


@pytest.mark.capability("attention.rotary.head_norm")
def test_forward_rotary_head_norm(platform: Platform, caps: Capabilities, device: Any) -> None:
    """``forward_rotary`` with per-head q/k RMS norms (``RotaryInput.head_norm``) on the same batches."""
    backend = platform.make_attention_backend()
    if not (backend.fuses_rotary and backend.fuses_head_norm):
        not_claimed("the attention backend does not fuse per-head q/k norms (the core normalises first)")
    check_cases(backend, caps, device, head_norm=True)


def check_cases(backend: Any, caps: Capabilities, device: Any, head_norm: bool) -> None:
    """Every case of :data:`CASES` the platform claims: output and cached keys against the reference."""
    for i, (lens, extra) in enumerate(CASES):
        if ("sliding_window" in extra and not caps.sliding_window) or ("soft_cap" in extra and not caps.logits_soft_cap):
            continue
        problem = build(caps, device, lens, seed=70 + i, **extra)
        norms = head_norm_weights(problem, seed=90 + i) if head_norm else None
        rotary, expected, k_stored = rotary_problem(problem, norms)
        kv_cache = problem.allocate_cache(backend)
        problem.fill_cache(backend, kv_cache)
        out = backend.forward_rotary(
            problem.query.clone(), problem.key.clone(), problem.value, kv_cache, problem.metadata, rotary
        )
        context = f"case {i}: query_lens {lens[0]} {extra}{' head_norm' if head_norm else ''}"
        mismatch = compare(out, expected.reference_output(), problem.tolerance(), "attention.rotary")
        if mismatch:
            pytest.fail(f"{mismatch} [{context}]", pytrace=False)
        cached = cached_new_keys(backend, kv_cache, problem)
        if cached is not None:
            mismatch = compare(cached.cpu(), k_stored.double(), problem.tolerance(), "attention.rotary cached keys")
            if mismatch:
                pytest.fail(f"{mismatch} [{context}]", pytrace=False)
