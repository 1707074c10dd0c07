"""The fused ops a model calls (the platform's overrides or the core's reference) and graph capture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.ops import OP_NAMES, reference_ops
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, default_geometry, torch_dtype
from engine_conformance.op_checks import FP8, check_op_result, spaced_router_logits
from engine_plugin_sdk.reference_ops import (
    make_cos_sin_cache,
    ref_add_layer_norm,
    ref_apply_token_bitmask,
    ref_fused_add_rms_norm,
    ref_gelu_tanh_and_mul,
    ref_layer_norm,
    ref_moe_topk,
    ref_post_norm_add_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from engine_plugin_sdk.tolerances import get_tolerance

HIDDEN = 256
EPS = 1e-5
#: logits width and the real vocabulary inside it (the columns past it are padding, never picked)
LOGITS_WIDTH, VOCAB = 300, 280
GRAPH_BUCKETS = [1, 2, 4, 8]
#: token bitmask words covering VOCAB (xgrammar's packing: 32 tokens per int32, least significant bit first)
BITMASK_WORDS = -(-VOCAB // 32)


def op_cases(op_name: str, dtype: torch.dtype, device: Any) -> tuple[tuple, tuple]:
    """``(args, expected)`` for one op: fresh random inputs and the float64 answers."""
    gen = torch.Generator().manual_seed(71 + OP_NAMES.index(op_name))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if op_name == "rms_norm":
        x, w = rand(9, HIDDEN), rand(HIDDEN)
        return (x, w, EPS), (ref_rms_norm(x, w, EPS),)
    if op_name == "fused_add_rms_norm":
        x, residual, w = rand(9, HIDDEN), rand(9, HIDDEN), rand(HIDDEN)
        return (x, residual, w, EPS), ref_fused_add_rms_norm(x, residual, w, EPS)
    if op_name == "rotary_embedding":
        positions = torch.randint(0, 512, (11,), generator=gen).to(device)
        q, k = rand(11, 8, 64), rand(11, 2, 64)
        cache = make_cos_sin_cache(512, 64).to(device)
        return (positions, q, k, cache), ref_rotary_embedding(positions, q, k, cache)
    if op_name == "silu_and_mul":
        x = rand(9, 2 * HIDDEN)
        return (x,), (ref_silu_and_mul(x),)
    if op_name == "gelu_tanh_and_mul":
        x = rand(9, 2 * HIDDEN)
        return (x,), (ref_gelu_tanh_and_mul(x),)
    if op_name == "layer_norm":
        # an offset mean, so that a kernel that skips the centring fails
        x, w, b = rand(9, HIDDEN) + 3.0, rand(HIDDEN), rand(HIDDEN)
        return (x, w, b, EPS), (ref_layer_norm(x, w, b, EPS),)
    if op_name == "fused_add_rms_norm_fp8":
        x, residual, w = rand(9, HIDDEN), rand(9, HIDDEN), rand(HIDDEN)
        return (x, residual, w, EPS, FP8), ref_fused_add_rms_norm(x, residual, w, EPS)
    if op_name == "silu_and_mul_fp8":
        x = rand(9, 2 * HIDDEN)
        return (x, FP8), (ref_silu_and_mul(x),)
    if op_name == "greedy_pick":
        # logits are float32 whatever the model dtype; the padding columns hold the largest values
        logits = (torch.randn(9, LOGITS_WIDTH, generator=gen) * 4).to(device)
        logits[:, VOCAB:] = 100.0
        raw = torch.log_softmax(logits[:, :VOCAB].double(), dim=-1)
        ids = raw.argmax(dim=-1)
        return (logits, VOCAB), (ids, raw.gather(1, ids.unsqueeze(1)).squeeze(1))
    if op_name == "apply_token_bitmask":
        return _bitmask_case(gen, dtype, device)
    if op_name == "post_norm_add_rms_norm":
        # a width that is not a power of two, and a branch far larger than the residual: a kernel that
        # adds before the post-norm, or skips it, is off by the branch's scale
        x, residual = rand(9, HIDDEN + 96) * 20, rand(9, HIDDEN + 96)
        post_w, w = rand(HIDDEN + 96), rand(HIDDEN + 96)
        return (x, residual, post_w, w, EPS), ref_post_norm_add_rms_norm(x, residual, post_w, w, EPS)
    if op_name == "moe_topk":
        return moe_topk_case(gen, dtype, device, renormalize=True)
    if op_name == "add_layer_norm":
        # offset means and a width that is not a power of two: a kernel that norms x alone, skips the
        # centring or reads past the row fails
        x, residual = rand(9, HIDDEN + 96) + 3.0, rand(9, HIDDEN + 96) * 4 - 1.0
        w, b = rand(HIDDEN + 96), rand(HIDDEN + 96)
        return (x, residual, w, b, EPS), (ref_add_layer_norm(x, residual, w, b, EPS),)
    raise ValueError(f"no test case for op {op_name!r}")


def moe_topk_case(gen: torch.Generator, dtype: torch.dtype, device: Any, renormalize: bool, experts: int = 40) -> tuple[tuple, tuple]:
    """Router logits ``[9, experts]`` (40: not a power of two) with an unambiguous top 6; float32 weights and
    int64 ids expected."""
    logits = spaced_router_logits(gen, 9, experts, 6).to(dtype)
    weights, ids = ref_moe_topk(logits, 6, renormalize)
    return (logits.to(device), 6, renormalize), (weights, ids)


def _bitmask_case(gen: torch.Generator, dtype: torch.dtype, device: Any) -> tuple[tuple, tuple]:
    """Logits ``[8, LOGITS_WIDTH]`` (width not a multiple of 32, padding past VOCAB) and a bitmask over
    VOCAB: random rows of several densities, a row allowing one token only, a row allowing all of VOCAB;
    a subset of rows masked, so the others must come back untouched."""
    rows = 8
    logits = (torch.randn(rows, LOGITS_WIDTH, generator=gen) * 4).to(dtype)
    density = torch.tensor([0.5, 0.05, 0.9, 0.5, 0.3, 0.5, 0.7, 0.5]).unsqueeze(1)
    allowed = torch.rand(rows, VOCAB, generator=gen) < density
    allowed[1] = False
    allowed[1, int(torch.randint(0, VOCAB, (1,), generator=gen))] = True
    allowed[2] = True
    bits = torch.zeros(rows, 32 * BITMASK_WORDS, dtype=torch.int64)
    bits[:, :VOCAB] = allowed.long()
    packed = (bits.view(rows, BITMASK_WORDS, 32) << torch.arange(32)).sum(-1)
    # the words as int32 (bit 31 makes a negative int32), as xgrammar stores them
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    indices = torch.tensor([0, 1, 2, 4, 5, 7])
    expected = ref_apply_token_bitmask(logits, bitmask, indices)
    return (logits.to(device), bitmask.to(device), indices.to(device)), (expected,)


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.capability("ops.{op_name}")
def test_fused_op(platform: Platform, caps: Capabilities, op_name: str, record_property: Any) -> None:
    overrides = platform.op_overrides()
    table = reference_ops().with_overrides(overrides)
    record_property("implementation", "platform override" if op_name in overrides else "core reference")
    op = getattr(table, op_name)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        args, expected = op_cases(op_name, dtype, platform.torch_device())
        # ops may work in place; keep the inputs the reference saw
        call_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        result = op(*call_args)
        check_op_result(op_name, result, expected, dtype, call_args, f"ops.{op_name} {dtype_name}")


def graph_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A small decode-like step: a matmul, a nonlinearity and a reduction."""
    return torch.nn.functional.silu(x @ w) * 2.0 + x.sum(dim=-1, keepdim=True)


@pytest.mark.capability("graph_capture")
def test_graph_replay_matches_eager(
    platform: Platform, caps: Capabilities, device: Any, record_property: Any
) -> None:
    dtype = default_geometry(caps).dtype
    gen = torch.Generator().manual_seed(81)

    def make_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, 64, generator=gen).to(dtype).to(device)
        w = (torch.randn(64, 64, generator=gen) * 0.125).to(dtype).to(device)
        return x, w

    capture = platform.make_graph_capture()
    capture.capture(graph_step, GRAPH_BUCKETS, make_inputs)
    captured = set(capture.captured_batch_sizes())
    if caps.graph_capture:
        missing = sorted(set(GRAPH_BUCKETS) - captured)
        if missing:
            pytest.fail(f"graph_capture: claimed, but buckets {missing} were not captured", pytrace=False)
    else:
        record_property("not_claimed", "no graphs; the eager fallback was checked")
    tol = get_tolerance(dtype)
    # every bucket twice with fresh inputs (a replay must read its new inputs), then an uncaptured size
    for batch_size in [*GRAPH_BUCKETS, *GRAPH_BUCKETS, 3]:
        x, w = make_inputs(batch_size)
        replayed = capture.run(batch_size, x, w).clone()
        assert_close(replayed, graph_step(x, w), tol, f"graph_capture (batch size {batch_size})")


#: (row of tied maxima, the columns holding them) for the tie check: the first column must win. The
#: vocabulary spans several 4096-column tiles, so ties across tiles of a split pick are covered too.
TIE_VOCAB, TIE_WIDTH = 2 * 4096 + 300, 2 * 4096 + 320
TIE_COLUMNS = (
    (10, 4100),  # tiles 0 and 1
    (5000, 8300),  # tiles 1 and 2
    (7, 8, 9),  # neighbours
    (4095, 4096),  # the last column of a tile and the first of the next
    (TIE_VOCAB - 1,),  # the last real column; the padding after it holds the same value
    (3, 2000, 6000, 8400),  # one in every tile
)


@pytest.mark.capability("ops.greedy_pick.ties")
def test_greedy_pick_ties(platform: Platform) -> None:
    """Several equal maxima in a row: the first index wins (core/engine/interfaces/ops.py), as torch's
    argmax picks it; a constant row picks column 0."""
    op = reference_ops().with_overrides(platform.op_overrides()).greedy_pick
    gen = torch.Generator().manual_seed(91)
    rows = len(TIE_COLUMNS) + 1
    logits = torch.randn(rows, TIE_WIDTH, generator=gen) * 4
    for row, columns in enumerate(TIE_COLUMNS):
        logits[row, list(columns)] = 50.0
    logits[:, TIE_VOCAB:] = 50.0  # padding equal to the maxima: still never picked
    logits[-1, :TIE_VOCAB] = 1.5  # every real column tied
    raw = torch.log_softmax(logits[:, :TIE_VOCAB].double(), dim=-1)
    ids = torch.tensor([columns[0] for columns in TIE_COLUMNS] + [0])
    expected = (ids, raw.gather(1, ids.unsqueeze(1)).squeeze(1))
    result = op(logits.to(platform.torch_device()), TIE_VOCAB)
    check_op_result("greedy_pick", result, expected, torch.float32, [], "ops.greedy_pick.ties")
