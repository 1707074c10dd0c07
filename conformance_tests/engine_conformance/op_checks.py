"""How an op's result is judged against its float64 reference (shared by the op tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.gemm import RowQuantizedActivations
from engine_conformance.helpers import assert_close
from engine_plugin_sdk.tolerances import FP8_ROWS_EXTRA, Tolerance, get_tolerance

#: the FP8 producer ops write this flavour (the reference quantizes to any e4m3)
FP8 = torch.float8_e4m3fn


def check_op_result(
    op_name: str, result: Any, expected: tuple, dtype: torch.dtype, call_args: list[Any], label: str
) -> None:
    """Judge one call of an op.

    Args:
        op_name: the op (its output conventions differ: in-place masking, token ids, FP8 rows).
        result: what the op returned.
        expected: the float64 reference outputs.
        dtype: the activation dtype of the call.
        call_args: the arguments the op was called with (an in-place op's result is its first one).
        label: prefix of failure messages, e.g. ``"ops.rms_norm float32"``.
    """
    if op_name == "apply_token_bitmask":
        check_masked(call_args[0], expected[0], dtype, label)
        return
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(expected):
        pytest.fail(f"{label}: returned {len(results)} tensors, expected {len(expected)}", pytrace=False)
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        out_label = f"{label} output {i}"
        if isinstance(got, RowQuantizedActivations):
            assert_close(dequantized(got, dtype, out_label), want, fp8_rows_tolerance(dtype), out_label)
            continue
        if op_name in ("greedy_pick", "moe_topk"):
            # (token ids, float32 log-probabilities) / (float32 weights, expert ids)
            check_pick(got, want, i if op_name == "greedy_pick" else 1 - i, out_label)
            continue
        # the residual sum may be kept in float32 (core/interfaces/ops.py)
        sums = op_name.startswith("fused_add_rms_norm") or op_name == "post_norm_add_rms_norm"
        wider_ok = sums and i == 1 and got.dtype == torch.float32
        if got.dtype != dtype and not wider_ok:
            pytest.fail(f"{out_label}: dtype {got.dtype}, expected {dtype}", pytrace=False)
        if tuple(got.shape) != tuple(want.shape):
            pytest.fail(f"{out_label}: shape {tuple(got.shape)}, expected {tuple(want.shape)}", pytrace=False)
        assert_close(got, want, get_tolerance(dtype), out_label)


def spaced_router_logits(gen: torch.Generator, rows: int, experts: int, top_k: int) -> torch.Tensor:
    """float32 router logits whose ``top_k`` largest per row sit at random experts, spaced 0.37 apart (exact
    enough in every dtype to keep their order), above the rest (normal, centred at -2)."""
    logits = torch.randn(rows, experts, generator=gen) * 0.5 - 2.0
    for r in range(rows):
        chosen = torch.randperm(experts, generator=gen)[:top_k]
        logits[r, chosen] = 1.0 + 0.37 * torch.arange(top_k, dtype=torch.float32)
    return logits


def dequantized(got: RowQuantizedActivations, dtype: torch.dtype, label: str) -> torch.Tensor:
    """The float64 values FP8 rows stand for, after checking their dtypes and shapes."""
    if got.data.dtype != FP8 or got.dtype != dtype or got.scale.dtype != torch.float32:
        pytest.fail(
            f"{label}: FP8 rows of {got.data.dtype} (scale {got.scale.dtype}) for {got.dtype}; "
            f"expected {FP8} (scale float32) for {dtype}",
            pytrace=False,
        )
    if got.scale.shape != (got.data.shape[0], 1):
        pytest.fail(
            f"{label}: scale shape {tuple(got.scale.shape)} for {got.data.shape[0]} rows", pytrace=False
        )
    return got.data.double().cpu() * got.scale.double().cpu()


def fp8_rows_tolerance(dtype: torch.dtype) -> Tolerance:
    """The dtype's tolerance plus the error of one e4m3 term per row."""
    base = get_tolerance(dtype)
    return Tolerance(base.atol + FP8_ROWS_EXTRA.atol, base.rtol + FP8_ROWS_EXTRA.rtol, 0.0)


def check_masked(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, label: str) -> None:
    """The logits masked in place: exactly ``-inf`` where disallowed, every other value unchanged."""
    if got.dtype != dtype:
        pytest.fail(
            f"{label}: the logits became {got.dtype}, expected {dtype} masked in place", pytrace=False
        )
    got64 = got.double().cpu()
    wrong = (got64 != want) & ~(got64.isnan() & want.isnan())
    if wrong.any():
        row, col = (int(v) for v in wrong.nonzero()[0])
        pytest.fail(
            f"{label}: {int(wrong.sum())} logits differ, first at row {row} column {col}: "
            f"{got64[row, col].item()} where {want[row, col].item()} was expected",
            pytrace=False,
        )


def check_pick(got: torch.Tensor, want: torch.Tensor, i: int, label: str) -> None:
    """Token ids exactly (int64), their log-probabilities at float32's tolerance (float32)."""
    expected_dtype = torch.int64 if i == 0 else torch.float32
    if got.dtype != expected_dtype or got.shape != want.shape:
        pytest.fail(
            f"{label}: {got.dtype} {tuple(got.shape)}, expected {expected_dtype} {tuple(want.shape)}",
            pytrace=False,
        )
    if i == 0 and not torch.equal(got.cpu(), want.cpu()):
        pytest.fail(f"{label}: picked tokens {got.tolist()}, expected {want.tolist()}", pytrace=False)
    if i == 1:
        assert_close(got, want, get_tolerance(torch.float32), label)
