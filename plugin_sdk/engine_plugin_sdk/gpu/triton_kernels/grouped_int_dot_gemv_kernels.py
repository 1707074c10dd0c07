"""The single-row product over 4- or 8-bit grouped codes by integer dot products: ``out[n] = sum_k x[perm[k]] *
W[n, k] (+ bias[n])`` for batch-1 decode, in the packed layout of :mod:`.grouped_int_kernels` (byte ``r`` of a
block of ``BLOCK`` columns holds column ``r`` in its low nibble and column ``BLOCK / 2 + r`` in its high one;
8-bit codes a byte a column), unchanged.

Why: the float GEMVs turn every code into a float before they multiply it. The word GEMV
(:mod:`.grouped_int4_gemv_kernels`) spends three shifts and eight logical ops a word of eight codes on that, all
on the integer pipe, which issues at half the FMA pipe's rate on Hopper; with its multiply-adds, its sums and its
activations' conversions it ran about six instructions a code, and Nsight Compute found it bound by issue. Here
the activations become 16-bit integers once a program, and ``dp2a`` (two 16-bit x 8-bit products added to a
32-bit sum, one instruction) multiplies them by the codes where they sit in the word's bytes: a word of eight
codes costs two ANDs (the low nibbles as bytes, the high ones as bytes times 16) and four ``dp2a``.

Each thread (a *slot*) takes 16 bytes of a row a step, four words: slot ``q`` of its block holds the low nibbles
of columns ``16 q .. 16 q + 15`` and the high nibbles of ``BLOCK / 2 + 16 q ..``; its activations are those two
runs of 16, read as eight pairs each. Word ``j``'s byte ``k`` is column ``16 q + 4 j + k``: ``dp2a.lo`` takes
bytes 0 and 1 against the pair of columns ``4 j, 4 j + 1`` and ``dp2a.hi`` bytes 2 and 3 against the next pair.
A slot's integer sum times its activations' scale is its share of the row's product in the group's codes; the
group scale (and the zero point or zero scale, against the slot's activation sum) apply once a slot a step.
8-bit codes (GGUF's Q6_K / Q8_0, 8-bit GPTQ) take 16 consecutive columns a slot, a word two ``dp2a`` as it is.

Precision: a slot's 32 activations (16 for 8-bit codes) are scaled by the power of two that takes their largest
magnitude below 2**15 and rounded to integers: exact for every bf16 activation within 2**7 of the largest (fp16:
2**4), else within 2**-16 of the largest; the integer sums are exact (below 2**28 a slot a step), and the float32
sums as in the other GEMVs. An infinite or NaN activation makes its slot's share, and so the row, NaN.

The slot's dot products (PTX on sm_61 and later; in the interpreter, ``ASM`` off, the same integer sums with plain
ops) are :mod:`.grouped_int_dot_products`'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_norm import norm_scales, normed_activations
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_operands import (
    _integer_pairs,
    _param_offsets,
    _program_rows,
    _slot_activations,
    _slot_params,
    _slot_words,
    _store,
    x_row,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_products import _slot_dots
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_dot_six_bit import six_bit_sums
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_gemv_rows import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_params import params_back, super_offsets
from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import prefetch_l2
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _prefetch_params(scale_ptr, zs_ptr, rows, stride_sn, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, BITS: tl.constexpr,
                     super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr, ASM: tl.constexpr,
                     PARAM_ROWS: tl.constexpr):  # fmt: skip
    """Ask the L2 cache for the lines of the first step's group parameters (:func:`_slot_params`' reads), holding
    no registers for them."""
    slots = tl.arange(0, S)
    params = _param_offsets(rows, stride_sn, slots, BLOCK, GROUP, BITS, PARAM_ROWS)
    ok = (slots < NUM_SLOTS)[None, :]
    prefetch_l2(scale_ptr + params, ok, ASM)
    if HAS_ZS:
        prefetch_l2(zs_ptr + params, ok, ASM)
    if SUB_GROUPS != 0:
        prefetch_l2(super_ptr + super_offsets(params, SUB_GROUPS, PARAM_ROWS), ok, ASM)
        if HAS_ZS:
            prefetch_l2(zsuper_ptr + super_offsets(params, SUB_GROUPS, PARAM_ROWS), ok, ASM)


@triton.jit
def _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr,
                BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, EVEN: tl.constexpr,
                BITS: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr,
                PARAM_ROWS: tl.constexpr):  # fmt: skip
    """The rows' words ``[R, S, 4]`` of slots ``s0 ..`` and their group scales (and zero scales) ``[R, S]`` in
    float32."""
    words = _slot_words(w32, rows, stride_w, s0, S, NUM_SLOTS, EVEN)
    scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, s0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                             super_ptr, zsuper_ptr, SUB_GROUPS, PARAM_ROWS)  # fmt: skip
    return words, scale, zs


@triton.jit
def _accumulate(acc, words, scale, zs, pl0, pl1, ph0, ph1, unit, x_sum, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
                ASM: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """``acc [R, S]`` plus the rows' products over one step's slots, its activations converted
    (:func:`_integer_pairs`)."""
    part = _slot_dots(words, pl0, pl1, ph0, ph1, ASM, BITS).to(tl.float32) * unit[None, :]
    if HAS_ZS:
        return acc + part * scale - zs * x_sum[None, :]
    elif ZERO != 0:
        return acc + (part - ZERO * x_sum[None, :]) * scale
    else:
        return acc + part * scale


@triton.jit
def _prepared_units(unit_ptr, total_ptr, s0, S: tl.constexpr, NUM_SLOTS: tl.constexpr):
    """Slots ``s0 ..``'s units and activation sums ``[S]`` as the norm's kernel wrote them (0 past the end)."""
    slots = s0 + tl.arange(0, S)
    ok = slots < NUM_SLOTS
    return tl.load(unit_ptr + slots, mask=ok, other=0.0), tl.load(total_ptr + slots, mask=ok, other=0.0)


@triton.jit
def _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO: tl.constexpr, HAS_ZS: tl.constexpr, FP16: tl.constexpr,
          ASM: tl.constexpr, BITS: tl.constexpr, PREPARED: tl.constexpr = False, unit_ptr=None, total_ptr=None, s0=0,
          NUM_SLOTS: tl.constexpr = 0):  # fmt: skip
    """``acc [R, S]`` plus the rows' products over one step's slots ``s0 ..`` (:func:`_slot_activations`' pairs), the
    activations converted once; with ``PREPARED`` the pairs are int16 already, each slot's unit and sum read
    beside them."""
    if PREPARED:
        unit, x_sum = _prepared_units(unit_ptr, total_ptr, s0, xl0.shape[0], NUM_SLOTS)
        return _accumulate(acc, words, scale, zs, xl0, xl1, xh0, xh1, unit, x_sum, ZERO, HAS_ZS, ASM, BITS)
    pl0, pl1, ph0, ph1, unit, x_sum, _ = _integer_pairs(xl0, xl1, xh0, xh1, FP16, HAS_ZS or ZERO != 0, ASM, BITS == 4)
    return _accumulate(acc, words, scale, zs, pl0, pl1, ph0, ph1, unit, x_sum, ZERO, HAS_ZS, ASM, BITS)


@triton.jit
def _first_step(x_ptr, w32, scale_ptr, zs_ptr, perm_ptr, rows, stride_w, stride_sn, NUM_SLOTS: tl.constexpr,
                GROUP: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK: tl.constexpr,
                S: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, BITS: tl.constexpr,
                super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr, EARLY_PARAMS: tl.constexpr,
                PREFETCH_PARAMS: tl.constexpr, PARAM_ROWS: tl.constexpr = 0, NORM: tl.constexpr = False,
                res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0, FP16: tl.constexpr = False,
                VECTOR_MASKS: tl.constexpr = False):  # fmt: skip
    """The rows' first step: its words, group parameters and activation pairs, across the PDL wait. The weight is
    constant: its words (and, with ``EARLY_PARAMS``, their scales; else with ``PREFETCH_PARAMS`` their L2 lines)
    are read while the kernel that writes ``x`` drains; what is read before the wait stays live across it, in
    registers. With ``NORM`` the activations are the normalised ``x + residual`` (:mod:`.grouped_int_dot_norm`),
    the norm's scales read before the wait."""
    words = _slot_words(w32, rows, stride_w, 0, S, NUM_SLOTS, EVEN)
    if NORM:
        wl0, wl1, wh0, wh1 = norm_scales(nw_ptr, S, NUM_SLOTS, BLOCK, BITS)
    if EARLY_PARAMS:
        scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                                 super_ptr, zsuper_ptr, SUB_GROUPS, PARAM_ROWS)  # fmt: skip
    elif PREFETCH_PARAMS:
        _prefetch_params(scale_ptr, zs_ptr, rows, stride_sn, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, BITS, super_ptr,
                         zsuper_ptr, SUB_GROUPS, ASM, PARAM_ROWS)  # fmt: skip
    if USE_PDL:
        gdc_wait()
    if not EARLY_PARAMS:
        scale, zs = _slot_params(scale_ptr, zs_ptr, rows, stride_sn, 0, S, NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS,
                                 super_ptr, zsuper_ptr, SUB_GROUPS, PARAM_ROWS)  # fmt: skip
    if NORM:
        xl0, xl1, xh0, xh1 = normed_activations(x_ptr, res_ptr, res_out_ptr, eps, wl0, wl1, wh0, wh1, S, NUM_SLOTS,
                                                BLOCK, BITS, FP16)  # fmt: skip
    else:
        xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, 0, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS,
                                               VECTOR_MASKS)  # fmt: skip
    return words, scale, zs, xl0, xl1, xh0, xh1


@triton.jit
def _row_groups(x_ptr, w32, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr, N, stride_w, stride_sn,
                NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
                HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                S: tl.constexpr, EVEN: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
                GATED: tl.constexpr, BITS: tl.constexpr, super_ptr, zsuper_ptr, SUB_GROUPS: tl.constexpr,
                EARLY_PARAMS: tl.constexpr, PREFETCH_PARAMS: tl.constexpr, GROUPS: tl.constexpr):  # fmt: skip
    """A single-step product's ``GROUPS`` groups of ``ROWS`` rows, one after another, each stored as it is done:
    each group's words and scales are read while the group before multiplies, so a program's loads stay in
    flight through its arithmetic; the activations are read and converted once for every group."""
    rows, first = _program_rows(N, ROWS, GATED, 0, GROUPS)
    words, scale, zs, xl0, xl1, xh0, xh1 = _first_step(x_ptr, w32, scale_ptr, zs_ptr, perm_ptr, rows, stride_w,
                                                       stride_sn, NUM_SLOTS, GROUP, HAS_ZS, HAS_PERM, BLOCK, S, EVEN,
                                                       ASM, USE_PDL, BITS, super_ptr, zsuper_ptr, SUB_GROUPS,
                                                       EARLY_PARAMS, PREFETCH_PARAMS)  # fmt: skip
    pl0, pl1, ph0, ph1, unit, x_sum, _ = _integer_pairs(xl0, xl1, xh0, xh1, FP16, HAS_ZS or ZERO != 0, ASM, BITS == 4)
    for g in tl.static_range(GROUPS):
        if g + 1 < GROUPS:
            next_rows, next_first = _program_rows(N, ROWS, GATED, g + 1, GROUPS)
            next_words = _slot_words(w32, next_rows, stride_w, 0, S, NUM_SLOTS, EVEN)
            next_scale, next_zs = _slot_params(scale_ptr, zs_ptr, next_rows, stride_sn, 0, S, NUM_SLOTS, BLOCK, GROUP,
                                               HAS_ZS, EVEN, BITS, super_ptr, zsuper_ptr, SUB_GROUPS)  # fmt: skip
        acc = _accumulate(tl.zeros((ROWS, S), dtype=tl.float32), words, scale, zs, pl0, pl1, ph0, ph1, unit, x_sum,
                          ZERO, HAS_ZS, ASM, BITS)  # fmt: skip
        _store(out_ptr, bias_ptr, first, N, tl.sum(acc, axis=1), ROWS, HAS_BIAS, GATED)
        if g + 1 < GROUPS:
            rows, first, words, scale, zs = next_rows, next_first, next_words, next_scale, next_zs


@triton.jit
def grouped_int_dot_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    N, stride_wn, stride_sn,
    NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr,
    FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr = -1, BITS: tl.constexpr = 4,
    AHEAD: tl.constexpr = False, super_ptr=None, zsuper_ptr=None, SUB_GROUPS: tl.constexpr = 0,
    EARLY_PARAMS: tl.constexpr = True, PREFETCH_PARAMS: tl.constexpr = False, plane_ptr=None, stride_pn=0,
    ROW_GROUPS: tl.constexpr = 1, PARAM_ROWS: tl.constexpr = 0, NORM: tl.constexpr = False, res_ptr=None,
    nw_ptr=None, res_out_ptr=None, eps=0.0, VECTOR_MASKS: tl.constexpr = False, PREPARED: tl.constexpr = False,
    unit_ptr=None, total_ptr=None, X_ROWS: tl.constexpr = 1, stride_xm=0, stride_om=0,
):  # fmt: skip
    """``out[n] = sum_k x[perm[k]] * W[n, k] (+ bias[n])`` for ``ROWS`` output features ``n``; or, with ``GATED``
    (an activation of :func:`.elementwise_kernels.gated_product`; ``ROWS`` even, no bias), ``act(gate[f]) * up[f]``
    for ``ROWS / 2`` features ``f`` of a weight stacking the gate's rows over the up rows (``out``: ``N / 2``).

    ``x``: ``[K]`` bf16 (fp16 with ``FP16``), 4-byte aligned; ``w``, ``scale``, ``zs``, ``perm``, ``bias`` as for
    :func:`~.grouped_int_kernels.grouped_int_gemv_kernel` with ``BITS``-bit codes (4-bit ones in blocks of
    ``BLOCK``, a multiple of 32, columns; 8-bit ones in groups of a multiple of 16), ``stride_wn`` (bytes) a
    multiple of 16; ``NUM_SLOTS`` is ``K / 32`` (``K / 16`` for 8-bit codes); ``WARPS`` the launch's
    ``num_warps`` (each step takes ``32 * WARPS`` slots of every row). ``AHEAD``: a reduction of several steps
    reads each step's words and activations before the step before it multiplies (twice the words in flight,
    for as many registers). Under PDL the first step's words are read before the wait, and with
    ``EARLY_PARAMS`` their group parameters too (else after it, their L2 lines asked for before it with
    ``PREFETCH_PARAMS``): what is read before the wait holds its registers across it. 6-bit codes (``BLOCK`` 32,
    ``NUM_SLOTS`` ``K / 32``, ``plane`` their high bits, ``stride_pn`` a multiple of 8; ``AHEAD`` and
    ``PREFETCH_PARAMS`` do not apply) take :func:`.grouped_int_dot_six_bit.six_bit_sums`. ``ROW_GROUPS`` (a single-step product of 4- or
    8-bit codes, ``NUM_SLOTS`` at most ``32 * WARPS``): a program takes that many groups of ``ROWS`` rows one after
    another (:func:`_row_groups`). ``PARAM_ROWS`` (``ROWS``; not with row groups): ``scale``,
    ``zs`` and their super-block scales are a program-order copy (:mod:`.grouped_int_program_params`), ``stride_sn``
    its elements a program. ``NORM`` (a single step of 4- or 8-bit codes, no permutation, one group of rows): ``x``
    is a branch's output and the product's input ``rms_norm(x + res) * nw`` (``eps``), the sum stored to
    ``res_out`` by the first program (:mod:`.grouped_int_dot_norm`; ``res``, ``nw``, ``res_out`` ``[K]`` in
    ``x``'s dtype, 4-byte aligned). ``VECTOR_MASKS``: a masked step reads its activations as 16-byte vectors
    (:func:`.grouped_int_dot_operands._pairs`). ``PREPARED`` (4- or 8-bit codes, no permutation, one group of
    rows): ``x`` is the row already converted (int16 ``[K]``) with each slot's unit in ``unit`` and
    activation sum in ``total`` (float32 ``[NUM_SLOTS]``, :mod:`.grouped_int_dot_prepared`), read in place of the
    program's own conversion. ``X_ROWS`` (one group of rows, neither ``NORM`` nor ``PREPARED``): ``x`` is
    ``[X_ROWS, K]`` (rows ``stride_xm`` apart, 4-byte aligned) and ``out`` ``[X_ROWS, N]`` (``stride_om``), each
    activation row its own program beside the others' over the same weight rows
    (:func:`.grouped_int_dot_operands.x_row`), a program-order copy's parameters those of its weight rows.
    """
    tl.static_assert(BITS == 8 or BLOCK % 32 == 0, "the slots are 32 columns of a block")
    tl.static_assert(BITS == 4 or GROUP % 16 == 0, "the slots are 16 columns of a group")
    tl.static_assert(BITS != 6 or BLOCK == 32, "6-bit slots are blocks of 32 columns")
    tl.static_assert(GATED == _NOT_GATED or (ROWS % 2 == 0 and not HAS_BIAS), "a gated GEMV runs even rows, no bias")
    S: tl.constexpr = 32 * WARPS
    EVEN: tl.constexpr = NUM_SLOTS % S == 0
    tl.static_assert(ROW_GROUPS == 1 or (NUM_SLOTS <= 32 * WARPS and BITS != 6), "row groups of single steps")
    tl.static_assert(PARAM_ROWS == 0 or (PARAM_ROWS == ROWS and ROW_GROUPS == 1),
                     "program-order parameters: one group of rows")
    tl.static_assert(not NORM or (NUM_SLOTS <= S and not HAS_PERM and BITS != 6 and ROW_GROUPS == 1),
                     "the residual norm: one step of 4- or 8-bit codes, no permutation, one group of rows")
    tl.static_assert(not PREPARED or (not HAS_PERM and BITS != 6 and ROW_GROUPS == 1 and not NORM),
                     "prepared activations: 4- or 8-bit codes, no permutation, one group of rows")
    tl.static_assert(X_ROWS == 1 or (ROW_GROUPS == 1 and not NORM and not PREPARED),
                     "several activation rows: one group of rows")
    if X_ROWS > 1:
        m = x_row(X_ROWS)
        x_ptr += m.to(tl.int64) * stride_xm
        out_ptr += m.to(tl.int64) * stride_om
        if PARAM_ROWS != 0:
            # the copy is laid out a weight-row program at a time and the operands find a program's by its launch
            # id: X_ROWS launch ids share one
            back = tl.program_id(0).to(tl.int64) - tl.program_id(0).to(tl.int64) // X_ROWS
            scale_ptr = params_back(scale_ptr, back, stride_sn, 0)
            zs_ptr = params_back(zs_ptr, back, stride_sn, 0)
            if SUB_GROUPS != 0:
                super_ptr = params_back(super_ptr, back, stride_sn, SUB_GROUPS, PARAM_ROWS)
                zsuper_ptr = params_back(zsuper_ptr, back, stride_sn, SUB_GROUPS, PARAM_ROWS)
    rows, first = _program_rows(N, ROWS, GATED, 0, ROW_GROUPS, X_ROWS)
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    stride_w = stride_wn // 4
    if USE_PDL:
        gdc_launch_dependents()
    if ROW_GROUPS > 1:
        _row_groups(x_ptr, w32, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr, N, stride_w, stride_sn, NUM_SLOTS, GROUP,
                    ZERO, HAS_ZS, HAS_PERM, HAS_BIAS, BLOCK, ROWS, S, EVEN, FP16, ASM, USE_PDL, GATED, BITS, super_ptr,
                    zsuper_ptr, SUB_GROUPS, EARLY_PARAMS, PREFETCH_PARAMS, ROW_GROUPS)  # fmt: skip
    elif BITS == 6:
        p16 = plane_ptr.to(tl.pointer_type(tl.int16))
        acc = six_bit_sums(x_ptr, w32, p16, scale_ptr, zs_ptr, perm_ptr, rows, stride_w, stride_pn // 2, stride_sn,
                            NUM_SLOTS, GROUP, ZERO, HAS_ZS, HAS_PERM, S, EVEN, FP16, ASM, USE_PDL, super_ptr,
                            zsuper_ptr, SUB_GROUPS, EARLY_PARAMS, PARAM_ROWS, VECTOR_MASKS)  # fmt: skip
    else:
        acc = tl.zeros((ROWS, S), dtype=tl.float32)
        words, scale, zs, xl0, xl1, xh0, xh1 = _first_step(x_ptr, w32, scale_ptr, zs_ptr, perm_ptr, rows, stride_w,
                                                           stride_sn, NUM_SLOTS, GROUP, HAS_ZS, HAS_PERM, BLOCK, S,
                                                           EVEN, ASM, USE_PDL, BITS, super_ptr, zsuper_ptr,
                                                           SUB_GROUPS, EARLY_PARAMS, PREFETCH_PARAMS,
                                                           PARAM_ROWS, NORM, res_ptr, nw_ptr, res_out_ptr, eps,
                                                           FP16, VECTOR_MASKS)  # fmt: skip
        if AHEAD and NUM_SLOTS > S:
            for s0 in tl.range(0, NUM_SLOTS, S):
                # the next step's words and activations are read before this step multiplies, so neither's latency
                # follows the arithmetic (the last step reads its own again, unused; masked past the end where the
                # steps do not fit)
                ahead = tl.minimum(s0 + S, NUM_SLOTS - S) if EVEN else s0 + S
                next_words, next_scale, next_zs = _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, ahead, S,
                                                              NUM_SLOTS, BLOCK, GROUP, HAS_ZS, EVEN, BITS, super_ptr,
                                                              zsuper_ptr, SUB_GROUPS, PARAM_ROWS)  # fmt: skip
                nl0, nl1, nh0, nh1 = _slot_activations(x_ptr, perm_ptr, ahead, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS,
                                                       VECTOR_MASKS)  # fmt: skip
                acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS, PREPARED, unit_ptr,
                            total_ptr, s0, NUM_SLOTS)  # fmt: skip
                words, scale, zs = next_words, next_scale, next_zs
                xl0, xl1, xh0, xh1 = nl0, nl1, nh0, nh1
        else:
            acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS, PREPARED, unit_ptr,
                        total_ptr, 0, NUM_SLOTS)  # fmt: skip
            for s0 in tl.range(S, NUM_SLOTS, S):
                words, scale, zs = _slot_tiles(w32, scale_ptr, zs_ptr, rows, stride_w, stride_sn, s0, S, NUM_SLOTS,
                                               BLOCK, GROUP, HAS_ZS, EVEN, BITS, super_ptr, zsuper_ptr, SUB_GROUPS,
                                               PARAM_ROWS)  # fmt: skip
                xl0, xl1, xh0, xh1 = _slot_activations(x_ptr, perm_ptr, s0, S, NUM_SLOTS, BLOCK, HAS_PERM, EVEN, BITS,
                                                       VECTOR_MASKS)  # fmt: skip
                acc = _step(acc, words, scale, zs, xl0, xl1, xh0, xh1, ZERO, HAS_ZS, FP16, ASM, BITS, PREPARED,
                            unit_ptr, total_ptr, s0, NUM_SLOTS)  # fmt: skip
    if ROW_GROUPS == 1:
        _store(out_ptr, bias_ptr, first, N, tl.sum(acc, axis=1), ROWS, HAS_BIAS, GATED)
