"""A grouped-integer weight's group parameters in the integer-dot GEMV's program order (``dot_gemv_program_params``).

Why: the one-row GEMV (:mod:`.grouped_int_dot_gemv_kernels`) gives each thread one slot of each of a program's
``R`` rows, so in the row-major ``[out, groups]`` layout a thread reads its parameters one row at a time: over
GGUF's Q4_K (a uint8 scale and zero scale a group, an fp16 pair a super-block) 32 scalar loads a step beside
eight 16-byte loads of codes, 127 registers in the sm_90 code (Triton 3.6, 8 rows, 4 warps). A copy laid out
``[programs, groups, R]`` (rows fastest; super-blocks ``[programs, groups / sub_groups, R]``) makes each of them
one vector load: 4 loads, 95 registers, 704 instructions against 752 (Q6_K's 8-bit codes: 24 loads against 52).
The copy holds the rows in the order the GEMV's programs take them: ``R`` consecutive rows, or for a gated
product the gate rows of ``R / 2`` features then their up rows; rows past the end repeat the last (their outputs
are never stored). It is built on the first product that asks for it (outside graph capture: the warm-up's
eager steps) and kept with the weight, as many bytes again as its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine_plugin_sdk.gpu.gemm import GroupedIntWeight


@dataclass(frozen=True, slots=True)
class ProgramParams:
    """A weight's group parameters in program order (see the module's docstring).

    Attributes:
        scales: ``[programs * groups * R]``, the weight's ``scales`` dtype.
        zero_scales: the same for ``zero_scales``, or None.
        super_scales: ``[programs * groups / sub_groups * R]``, or None without two-level scales.
        super_zero_scales: the same for ``super_zero_scales``, or None.
        stride: elements of ``scales`` a program (``groups * R``).
    """

    scales: torch.Tensor
    zero_scales: torch.Tensor | None
    super_scales: torch.Tensor | None
    super_zero_scales: torch.Tensor | None
    stride: int


def program_rows(out_features: int, rows: int, gated: bool) -> torch.Tensor:
    """int64 ``[programs, rows]``: the weight rows each GEMV program takes, past the end the last again.

    Args:
        out_features: the weight's rows (a gated weight's gate rows over as many up rows).
        rows: rows a program (even where ``gated``).
        gated: the GEMV fuses the gated activation: a program takes ``rows / 2`` features' gate and up rows.
    """
    if not gated:
        index = torch.arange(triton.cdiv(out_features, rows) * rows)
        return index.clamp(max=out_features - 1).reshape(-1, rows)
    half, features = out_features // 2, rows // 2
    gate = torch.arange(triton.cdiv(half, features) * features).clamp(max=half - 1).reshape(-1, features)
    return torch.cat([gate, gate + half], dim=1)


def _reordered(params: torch.Tensor | None, order: torch.Tensor) -> torch.Tensor | None:
    """``params [out, columns]`` as ``[programs, columns, R]`` for ``order [programs, R]``, flat."""
    if params is None:
        return None
    return params[order.to(params.device)].transpose(1, 2).contiguous().reshape(-1)


def program_params(weight: GroupedIntWeight, rows: int, gated: bool) -> ProgramParams:
    """``weight``'s program-order parameters for a GEMV of ``rows`` rows a program (built once, kept).

    Args:
        weight: 4-, 6- or 8-bit codes.
        rows: rows a program.
        gated: whether the GEMV fuses the gated activation (:func:`program_rows`).

    Returns:
        The copy.

    Raises:
        ValueError: for an odd ``rows`` for a gated product.
    """
    key = (rows, gated)
    kept = weight.program_params.get(key)
    if kept is not None:
        return kept
    if gated and rows % 2:
        raise ValueError(f"no program-order parameters for a gated product at {rows} rows")
    order = program_rows(weight.shape[0], rows, gated)
    made = ProgramParams(
        scales=_reordered(weight.scales, order),
        zero_scales=_reordered(weight.zero_scales, order),
        super_scales=_reordered(weight.super_scales, order),
        super_zero_scales=_reordered(weight.super_zero_scales, order),
        stride=int(weight.scales.shape[1]) * rows,
    )
    weight.program_params[key] = made
    return made
