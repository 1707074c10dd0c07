"""One launch of the integer-dot GEMV over a projection's two row blocks in different code forms (``dot_gemv_row_blocks``).

Why: GGUF Q4_K_M stores ``attn_v`` in Q6_K in half of a model's layers and q / k in Q4_K, so their q/k/v projection
is two weights (:class:`~engine_plugin_sdk.gpu.gemm.GroupedIntRowBlocks`), and at batch 1 two launches where a
uniform layer runs one: the second (v, 1,024 rows of Llama-3-8B at 8 rows a program: 128 programs, fewer than an
H100's or H200's multiprocessors) pays a launch, its PDL wait and its own drain for 4.5 MB (4.75 us of an H100's
time without PDL, at 0.95 TB/s). Here the programs before ``SPLIT / ROWS`` take the first block and the rest the
second, each through :func:`~.grouped_int_dot_gemv_kernels.grouped_int_dot_gemv_kernel`'s body with its own
block's form (both bodies compile into the kernel; a program runs one).

The second block's programs number their rows and output features as the joined weight's (``SPLIT`` on), so
the body reads that block's codes, parameters and plane through pointers set back by ``SPLIT`` rows (by ``SPLIT /
ROWS`` programs for a program-order copy of its parameters); its outputs land after the first block's in one
``[N]`` row, which the caller splits into q, k and v as it splits a uniform projection's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_gemv_kernels import grouped_int_dot_gemv_kernel
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import params_back


@triton.jit
def grouped_int_dot_gemv_blocks_kernel(
    x_ptr, bias_ptr, out_ptr, N,
    w_a, scale_a, zs_a, super_a, zsuper_a, plane_a, stride_wn_a, stride_sn_a, stride_pn_a,
    w_b, scale_b, zs_b, super_b, zsuper_b, plane_b, stride_wn_b, stride_sn_b, stride_pn_b,
    SPLIT: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr, HAS_BIAS: tl.constexpr, FP16: tl.constexpr,
    ASM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_PARAMS: tl.constexpr, VECTOR_MASKS: tl.constexpr,
    SLOTS_A: tl.constexpr, GROUP_A: tl.constexpr, ZERO_A: tl.constexpr, HAS_ZS_A: tl.constexpr, BLOCK_A: tl.constexpr,
    BITS_A: tl.constexpr, AHEAD_A: tl.constexpr, SUB_GROUPS_A: tl.constexpr, EARLY_A: tl.constexpr,
    PARAM_ROWS_A: tl.constexpr,
    SLOTS_B: tl.constexpr, GROUP_B: tl.constexpr, ZERO_B: tl.constexpr, HAS_ZS_B: tl.constexpr, BLOCK_B: tl.constexpr,
    BITS_B: tl.constexpr, AHEAD_B: tl.constexpr, SUB_GROUPS_B: tl.constexpr, EARLY_B: tl.constexpr,
    PARAM_ROWS_B: tl.constexpr,
):  # fmt: skip
    """``out[n] = W[n] . x (+ bias[n])`` for ``W`` the first block's ``SPLIT`` rows over the second's (``N`` in
    all, ``SPLIT`` a multiple of ``ROWS``), no permutation, not gated; each block's arguments (``_a``, ``_b``) as
    :func:`~.grouped_int_dot_gemv_kernels.grouped_int_dot_gemv_kernel` takes them for it alone, ``x``, ``bias``
    and ``out`` the joined row's."""
    tl.static_assert(SPLIT % ROWS == 0, "the first block's rows are whole programs")
    if tl.program_id(0) < SPLIT // ROWS:
        grouped_int_dot_gemv_kernel(
            x_ptr, w_a, scale_a, zs_a, x_ptr, bias_ptr, out_ptr, SPLIT, stride_wn_a, stride_sn_a,
            NUM_SLOTS=SLOTS_A, GROUP=GROUP_A, ZERO=ZERO_A, HAS_ZS=HAS_ZS_A, HAS_PERM=False, HAS_BIAS=HAS_BIAS,
            BLOCK=BLOCK_A, ROWS=ROWS, WARPS=WARPS, FP16=FP16, ASM=ASM, USE_PDL=USE_PDL, GATED=_NOT_GATED,
            BITS=BITS_A, AHEAD=AHEAD_A, super_ptr=super_a, zsuper_ptr=zsuper_a, SUB_GROUPS=SUB_GROUPS_A,
            EARLY_PARAMS=EARLY_A, PREFETCH_PARAMS=PREFETCH_PARAMS, plane_ptr=plane_a, stride_pn=stride_pn_a,
            PARAM_ROWS=PARAM_ROWS_A, VECTOR_MASKS=VECTOR_MASKS,
        )  # fmt: skip
    else:
        # a program-order copy is laid out by program (its stride a program's), row-major parameters by row
        back: tl.constexpr = SPLIT // ROWS if PARAM_ROWS_B != 0 else SPLIT
        grouped_int_dot_gemv_kernel(
            x_ptr, w_b - SPLIT * stride_wn_b, scale_b - back * stride_sn_b, zs_b - back * stride_sn_b, x_ptr,
            bias_ptr, out_ptr, N, stride_wn_b, stride_sn_b,
            NUM_SLOTS=SLOTS_B, GROUP=GROUP_B, ZERO=ZERO_B, HAS_ZS=HAS_ZS_B, HAS_PERM=False, HAS_BIAS=HAS_BIAS,
            BLOCK=BLOCK_B, ROWS=ROWS, WARPS=WARPS, FP16=FP16, ASM=ASM, USE_PDL=USE_PDL, GATED=_NOT_GATED,
            BITS=BITS_B, AHEAD=AHEAD_B, super_ptr=params_back(super_b, back, stride_sn_b, SUB_GROUPS_B),
            zsuper_ptr=params_back(zsuper_b, back, stride_sn_b, SUB_GROUPS_B), SUB_GROUPS=SUB_GROUPS_B,
            EARLY_PARAMS=EARLY_B, PREFETCH_PARAMS=PREFETCH_PARAMS, plane_ptr=plane_b - SPLIT * stride_pn_b,
            stride_pn=stride_pn_b, PARAM_ROWS=PARAM_ROWS_B, VECTOR_MASKS=VECTOR_MASKS,
        )  # fmt: skip

