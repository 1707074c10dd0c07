"""Mixture-of-experts kernels: the experts' two projections in two forms (the routing before them:
:mod:`.moe_routing_kernels`).

Experts are stacked: ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``, rows contiguous
along the reduced dimension. A *slot* is one (token, choice) pair, ``slot = token * top_k + j``.

- **Few slots (decode)**: GEMV-style kernels, one program per slot and tile of output rows. The first fuses
  both halves of ``gate_up`` with SiLU-and-mul; the second reads the ``top_k`` experts of one token and
  sums their weighted outputs in registers (no atomics, so the sum's order is fixed), expert by expert or
  (``moe_gemv_down_experts_kernel``) all its experts' tiles in one gather. Weights stream at the GEMV's
  bandwidth, and nothing needs sorting.
- **Many slots (prefill, large batches)**: slots are grouped by expert (``moe_align_kernel``, one program
  per expert, every group padded to ``BLOCK_M`` rows), then ``moe_gemm_kernel`` runs one tensor-core tile
  per (group block, output tile), gathering its activation rows and scattering its results by slot.

Everything stays on the device (no host reads of counts), so both forms can be captured in a CUDA graph.
FP8 experts (``HAS_SCALE``) are read as FP8 and scaled per output channel after the reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _gated(gate, up, ACT: tl.constexpr):
    """The experts' gated activation: SiLU (``ACT == 0``) or gpt-oss's clamped SwiGLU (``ACT == 1``)."""
    if ACT == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    g = tl.minimum(gate, 7.0)
    u = tl.minimum(tl.maximum(up, -7.0), 7.0)
    return (u + 1.0) * g / (1.0 + tl.exp(-1.702 * g))


@triton.jit
def moe_gemv_gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, ids_ptr, out_ptr,
    INTER, stride_x, stride_we, stride_wn, stride_o, stride_se, stride_be,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """``out[slot, n] = silu(gate_e[n] . x[token]) * (up_e[n] . x[token])`` for one slot's expert ``e``.

    ``K`` is a compile-time constant, so the reduction loop unrolls and every weight tile's load can be
    issued before the first one is used: a program keeps several tiles in flight, as streaming needs.
    Under PDL it waits at once: which expert's rows it reads is the routing kernel's output; and only then
    lets the down kernel start, which reads the routing before its own wait (:func:`moe_gemv_down_kernel`).
    """
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K) * stride_x
    gate_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(gate_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        u = tl.load(up_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        gate *= tl.load(scale_ptr + expert * stride_se + rows)
        up *= tl.load(scale_ptr + expert * stride_se + rows + INTER)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + rows).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + rows + INTER).to(tl.float32)
    # the projections round to the activation dtype first, as a plain GEMM's output would
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = _gated(gate, up, ACT)
    tl.store(out_ptr + slot * stride_o + offs_n, act.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_tile(w_ptr, ids_ptr, slot, rows, stride_we, stride_wn, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first ``BLOCK_K`` columns of ``rows`` of slot ``slot``'s down expert, its id read past L1 (the
    routing was written by a kernel that ended before this one started, but an SM's L1 may still hold the
    previous layer's)."""
    expert = tl.load(ids_ptr + slot, cache_modifier=".cg").to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :],
                   mask=offs_k[None, :] < K, other=0.0)


@triton.jit
def moe_gemv_down_kernel(
    act_ptr, w_ptr, scale_ptr, bias_ptr, ids_ptr, topw_ptr, out_ptr,
    H, stride_a, stride_we, stride_wn, stride_o, stride_se, stride_be,
    K: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    """``out[t, n] = sum_j w[t, j] * (down_{e_j}[n] . act[t * TOP_K + j])``: one token's experts, summed here
    (both loops unroll: the ``TOP_K`` experts' tiles load independently of each other).

    Under PDL the programs start while the gate/up kernel drains (it lets them start only after its own
    wait, so the routing is complete): each loads the first tile of its first ``PREFETCH`` (0 to 4) experts
    before it waits for the activations, so those weights stream during that kernel's tail.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    if USE_PDL:
        gdc_launch_dependents()
        p0 = _down_tile(w_ptr, ids_ptr, t * TOP_K, rows, stride_we, stride_wn, K, BLOCK_K)
        p1 = p0
        p2 = p0
        p3 = p0
        if PREFETCH >= 2 and TOP_K >= 2:
            p1 = _down_tile(w_ptr, ids_ptr, t * TOP_K + 1, rows, stride_we, stride_wn, K, BLOCK_K)
        if PREFETCH >= 3 and TOP_K >= 3:
            p2 = _down_tile(w_ptr, ids_ptr, t * TOP_K + 2, rows, stride_we, stride_wn, K, BLOCK_K)
        if PREFETCH >= 4 and TOP_K >= 4:
            p3 = _down_tile(w_ptr, ids_ptr, t * TOP_K + 3, rows, stride_we, stride_wn, K, BLOCK_K)
        gdc_wait()
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = t * TOP_K + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        a_row = act_ptr + slot * stride_a
        w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if USE_PDL and k0 == 0 and j < PREFETCH:
                if j == 0:
                    w = p0
                elif j == 1:
                    w = p1
                elif j == 2:
                    w = p2
                else:
                    w = p3
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        part = tl.sum(acc, axis=1)
        if HAS_SCALE:
            part *= tl.load(scale_ptr + expert * stride_se + rows)
        if HAS_BIAS:
            part += tl.load(bias_ptr + expert * stride_be + rows).to(tl.float32)
        y += tl.load(topw_ptr + slot).to(tl.float32) * part
    tl.store(out_ptr + t * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_gemv_down_experts_kernel(
    act_ptr, w_ptr, scale_ptr, bias_ptr, ids_ptr, topw_ptr, out_ptr,
    H, stride_a, stride_we, stride_wn, stride_o, stride_se, stride_be,
    K: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """What :func:`moe_gemv_down_kernel` computes, with the token's ``TOP_K`` experts as one dimension of the
    tiles (``K_P2`` its power of two): their ids are one load and their first tiles one gather, so no expert's
    weights wait behind another's id. The loop over experts there compiles to an id load and a dependent
    tile load an expert, issued late for the experts past its early ones; here every tile of the first
    ``BLOCK_K`` columns is in flight at once (more registers a program: fewer programs per SM).

    Under PDL it reads the ids and first tiles before it waits (as the other kernel's early tiles: the
    gate/up kernel lets it start only once the routing is complete).
    """
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_j = tl.arange(0, K_P2)
    j_ok = offs_j < TOP_K
    slots = t * TOP_K + offs_j
    offs_k = tl.arange(0, BLOCK_K)
    if USE_PDL:
        gdc_launch_dependents()
    # past L1: an SM's L1 may still hold the previous layer's routing
    experts = tl.load(ids_ptr + slots, mask=j_ok, other=0, cache_modifier=".cg").to(tl.int64)
    w_rows = w_ptr + experts[:, None, None] * stride_we + rows[None, :, None] * stride_wn
    first = tl.load(w_rows + offs_k[None, None, :], mask=j_ok[:, None, None] & (offs_k < K)[None, None, :], other=0.0)
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros((K_P2, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        cols = k0 + offs_k
        k_ok = cols < K
        a = tl.load(act_ptr + slots[:, None] * stride_a + cols[None, :], mask=j_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = first
        if k0 > 0:
            w = tl.load(w_rows + cols[None, None, :], mask=j_ok[:, None, None] & k_ok[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + experts[:, None] * stride_se + rows[None, :], mask=j_ok[:, None], other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + experts[:, None] * stride_be + rows[None, :], mask=j_ok[:, None],
                       other=0.0).to(tl.float32)  # fmt: skip
    # the weighted sum over the token's experts in one reduction (its order fixed by the tile, run to run)
    y = tl.sum(acc * tl.load(topw_ptr + slots, mask=j_ok, other=0.0).to(tl.float32)[:, None], axis=0)
    tl.store(out_ptr + t * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_slots,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program ``e`` writes expert ``e``'s slots (ascending) into its group of ``sorted``, pads the group to a
    multiple of ``BLOCK_M`` with ``num_slots`` (no slot), and names ``e`` for each of the group's blocks.

    Every program counts all experts itself (a vector of ``BLOCK_E`` counts) to find where its group starts;
    program 0 also writes the padded total, past which the GEMM's blocks have nothing to do.
    """
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s0 in range(0, num_slots, BLOCK_T):
        offs = s0 + tl.arange(0, BLOCK_T)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
        counts += tl.sum((ids[None, :] == offs_e[:, None]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
    count = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    group = tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
    if e == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    seen = 0
    for s0 in range(0, num_slots, BLOCK_T):
        offs = s0 + tl.arange(0, BLOCK_T)
        mine = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32) == e
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1 + seen
        tl.store(sorted_ptr + start + rank, offs, mask=mine)
        seen += tl.sum(mine.to(tl.int32), axis=0)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + count + offs_m, num_slots + tl.zeros([BLOCK_M], dtype=tl.int32),
             mask=offs_m < group - count)  # fmt: skip
    for b in range(0, group // BLOCK_M):
        tl.store(block_expert_ptr + start // BLOCK_M + b, e)


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, bias_ptr, sorted_ptr, block_expert_ptr, total_ptr, topw_ptr, c_ptr,
    N, K, num_slots, stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_be,
    A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One block of an expert's group against one tile of its weight's rows.

    Row ``i`` of the block is slot ``sorted[i]``: its activation row is ``a[slot // A_DIV]`` (the token for
    ``gate_up``, the slot itself for ``down``) and its result goes to ``c[slot]``. ``GATED`` reads rows
    ``n`` and ``n + N`` of the weight and writes their gated activation (``ACT``); ``HAS_BIAS`` adds the
    expert's bias first; ``MUL_WEIGHT`` scales each row by its slot's routing weight.
    """
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_slots
    rows_a = tl.where(valid, slots // A_DIV, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_w = tl.where(n_ok, offs_n, 0).to(tl.int64)
    w_base = w_ptr + expert * stride_we + rows_w[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows_a[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + offs_k[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        if GATED:
            bu = tl.load(w_base + N * stride_wn + offs_k[:, None], mask=k_ok[:, None], other=0.0)
            acc_u = tl.dot(a, bu.to(a.dtype), acc_u, input_precision=PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * stride_se + rows_w)[None, :]
        if GATED:
            acc_u *= tl.load(scale_ptr + expert * stride_se + rows_w + N)[None, :]
    gemm_epilogue(acc, acc_u, bias_ptr + expert * stride_be, rows_w, N, topw_ptr, slots, valid, c_ptr, stride_cm,
                  offs_n, n_ok, GATED, MUL_WEIGHT, HAS_BIAS, ACT)  # fmt: skip


@triton.jit
def gemm_epilogue(acc, acc_u, bias_row, rows_w, N, topw_ptr, slots, valid, c_ptr, stride_cm, offs_n, n_ok,
                  GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """A grouped-GEMM tile's end: the expert's bias (``bias_row``, its rows ``rows_w`` and, gated, ``rows_w + N``),
    the gated activation of the gate and up products rounded to the output dtype first (as a plain GEMM's output
    would be), the slots' routing weights, and the store by slot."""
    if HAS_BIAS:
        acc += tl.load(bias_row + rows_w).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(bias_row + rows_w + N).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_u.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = _gated(gate, up, ACT)
    if MUL_WEIGHT:
        acc *= tl.load(topw_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])  # fmt: skip
