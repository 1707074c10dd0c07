"""Small helpers the conformance tests share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_plugin_sdk.dtypes import torch_dtype as sdk_torch_dtype
from engine_plugin_sdk.problems import AttentionProblem
from engine_plugin_sdk.tolerances import Tolerance, compare


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype for a capability dtype name, or for the dtype of a platform's array (torch, numpy, JAX).

    Raises:
        pytest.fail.Exception: for a name torch does not know (the claim itself is wrong).
    """
    try:
        return sdk_torch_dtype(dtype)
    except ValueError:
        pytest.fail(f"the platform claims dtype {dtype!r}, which is not a torch dtype name")


@dataclass(frozen=True, slots=True)
class Geometry:
    """The attention geometry a test uses when it is not about geometry."""

    dtype: torch.dtype
    head_size: int
    block_size: int


def default_geometry(caps: Capabilities) -> Geometry:
    """float32 and head size 64 / block size 16 where claimed (tightest and quickest), else the first claims."""
    dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    head = 64 if 64 in caps.head_sizes else min(caps.head_sizes)
    block = 16 if 16 in caps.block_sizes else caps.block_sizes[0]
    return Geometry(torch_dtype(dtype), head, block)


def most_precise_dtype(caps: Capabilities) -> str:
    """The most precise model dtype the plugin claims: float32, then fp16 before bf16 (10 mantissa bits
    against 7), else its first claim; the end-to-end rows compare against transformers in it."""
    return next((d for d in ("float32", "float16", "bfloat16") if d in caps.dtypes), caps.dtypes[0])


def assert_close(actual: Any, expected: Any, tol: Tolerance, capability: str) -> None:
    """Fail with a message that starts with the capability name when ``actual`` is out of tolerance."""
    problem = compare(actual, expected, tol, capability)
    if problem:
        pytest.fail(problem, pytrace=False)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, capability: str) -> None:
    """Fail unless the tensors are bitwise equal (cache copies and writes must be exact)."""
    if actual.shape != expected.shape:
        pytest.fail(
            f"{capability}: shape {tuple(actual.shape)} differs from {tuple(expected.shape)}", pytrace=False
        )
    if actual.dtype != expected.dtype:
        pytest.fail(f"{capability}: dtype {actual.dtype} differs from {expected.dtype}", pytrace=False)
    # compare bit patterns: exact, NaN-safe, and defined for float8 too
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a = actual.detach().cpu().contiguous().view(as_int)
    e = expected.detach().cpu().contiguous().view(as_int)
    same = a == e
    if not bool(same.all()):
        pytest.fail(
            f"{capability}: {int((~same).sum())}/{a.numel()} elements differ from the expected cache",
            pytrace=False,
        )


def run_attention_problem(
    platform: Platform, problem: AttentionProblem, capability: str, context: str = ""
) -> None:
    """Run ``problem`` on a fresh backend of ``platform`` and fail unless it matches the float64 reference.

    The failure reads ``<capability>: <worst mismatch> [<context>]``: the context (geometry, batch) comes
    last so that a report's shortened detail keeps the mismatch itself.
    """
    out = problem.run(platform.make_attention_backend())
    mismatch = compare(out, problem.reference_output(), problem.tolerance(), capability)
    if mismatch:
        pytest.fail(f"{mismatch} [{context}]" if context else mismatch, pytrace=False)


def check_unclaimed_attention_feature(
    platform: Platform, problem: AttentionProblem, capability: str, record_property: Any
) -> None:
    """An unclaimed feature must be refused (ValueError / NotImplementedError), never silently ignored.

    Records the ``not_claimed`` property, which the runner reports as "not claimed" with its text; fails
    when the backend accepted the feature and returned a wrong result.
    """
    try:
        out = problem.run(platform.make_attention_backend())
    except (ValueError, NotImplementedError) as exc:
        record_property("not_claimed", f"rejected: {type(exc).__name__}: {exc}")
        return
    if compare(out, problem.reference_output(), problem.tolerance(), capability):
        pytest.fail(
            f"{capability}: not claimed, yet forward() accepted it and returned a wrong result", pytrace=False
        )
    record_property("not_claimed", "not claimed, but computed correctly")
