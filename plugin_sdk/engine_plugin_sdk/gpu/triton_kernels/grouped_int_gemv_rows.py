"""Which weight rows a grouped-integer GEMV program (:mod:`.grouped_int_kernels`' byte GEMV,
:mod:`.grouped_int4_gemv_kernels`' word GEMV) accumulates, and how it stores their sums: ``ROWS`` consecutive
output features, or, for a gate/up product with its activation in the epilogue (``GATED``), two features' gate
rows and their up rows, stored as ``act(gate) * up``."""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product

#: ``GATED`` of the GEMVs' plain product (else :data:`.elementwise_kernels.SILU` or ``GELU_TANH``: a gate/up
#: product with its activation in the epilogue)
NOT_GATED = -1
_NOT_GATED = tl.constexpr(NOT_GATED)


@triton.jit
def _program_rows(N, ROWS: tl.constexpr, GATED: tl.constexpr):
    """The weight rows of the program's accumulators, and the first output feature: ``ROWS`` consecutive
    rows (past ``N`` row ``N - 1`` again, never stored); with ``GATED`` the gate rows of two features ``f``,
    ``f + 1`` and then their up rows ``N / 2 + f``, ``N / 2 + f + 1`` (past the features' end the last again)."""
    if GATED == _NOT_GATED:
        row0 = tl.program_id(0) * ROWS
        return row0, tl.minimum(row0 + 1, N - 1), tl.minimum(row0 + 2, N - 1), tl.minimum(row0 + 3, N - 1), row0
    else:
        f = tl.program_id(0) * 2
        g1 = tl.minimum(f + 1, N // 2 - 1)
        return f, g1, N // 2 + f, N // 2 + g1, f


@triton.jit
def _store_rows(out_ptr, bias_ptr, first_out, N, y0, y1, y2, y3, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                GATED: tl.constexpr):  # fmt: skip
    """A GEMV program's outputs from its rows' sums (:func:`_program_rows`' rows): ``ROWS`` consecutive features
    from ``first_out`` (before ``N``), or with ``GATED`` ``act(gate) * up`` of features ``first_out`` and
    ``first_out + 1`` (before ``N / 2``)."""
    if GATED == _NOT_GATED:
        _gemv_store(out_ptr, bias_ptr, first_out, N, y0, HAS_BIAS)
        if ROWS > 1:
            _gemv_store(out_ptr, bias_ptr, first_out + 1, N, y1, HAS_BIAS)
        if ROWS > 2:
            _gemv_store(out_ptr, bias_ptr, first_out + 2, N, y2, HAS_BIAS)
            _gemv_store(out_ptr, bias_ptr, first_out + 3, N, y3, HAS_BIAS)
    else:
        g0 = gated_product(y0, y2, GATED)
        g1 = gated_product(y1, y3, GATED)
        tl.store(out_ptr + first_out, g0.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + first_out + 1, g1.to(out_ptr.dtype.element_ty), mask=first_out + 1 < N // 2)


@triton.jit
def _gemv_store(out_ptr, bias_ptr, row, N, y, HAS_BIAS: tl.constexpr):
    """Output feature ``row`` (before ``N``): the sum ``y``, plus its bias."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + row, mask=row < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty), mask=row < N)
