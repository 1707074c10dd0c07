"""The product of 1 to 8 activation rows (decode, the LM head, small verification batches) with 4-bit grouped
codes, each 32-bit word of codes read straight into a tensor-core fragment: ``out[m, n] = sum_k x[m, perm[k]] *
W[n, k] (+ bias[n])``, in the packed layout of :mod:`.grouped_int_kernels` (byte ``r`` of a block of ``BLOCK``
columns holds column ``r`` in its low nibble and column ``BLOCK / 2 + r`` in its high one), unchanged.

Why: at batch 1 the CUDA-core GEMVs spend five or more instructions a code turning codes into floats and
multiplying them (an H200 streamed 4-bit weights at under 2 TB/s, bound by issue, not by memory), and a
``tl.dot`` over dequantized tiles moves every tile through shared memory. A warp-level ``mma.m16n8k16`` takes
its operands from registers: lane ``l = 4 g + t`` holds weight rows ``g`` and ``g + 8`` at reduction slots
``2t, 2t + 1, 2t + 8, 2t + 9`` and activation row ``g`` at the same slots. Which reduction column a slot stands
for is free as long as both operands agree, so a lane reads the 16 bytes ``16 t .. 16 t + 15`` of a 128-column
chunk of each of its two weight rows (vector loads, no repacking) and takes, from each word, bytes 0 and 2
(then 1 and 3) as one slot pair: one AND-OR a pair of nibbles makes the bf16 ``128 + code`` (fp16 ``1024 +
code``), so a word of eight codes costs three shifts and four logical ops, and two ``mma`` do its
multiply-adds. The activations come as bf16 pairs whose halves a byte permute matches to those slots. A
second ``mma`` with ones in place of the codes sums the activations, and ``(128 + zero) * sum`` comes off once
a chunk, with the group scale, in float32.

Each program takes 16 output features; its warps split the chunks and their sums are added at the end. A warp
reads its chunks' words ``DEPTH`` iterations ahead (``GroupedIntTiles.fragment_depth``): ptxas places a loop's
loads after most of its ``mma`` work, so a read-ahead of one iteration leaves a memory latency a chunk exposed
(``benchmarks/sass_shape.py`` shows where the loads land). The
PTX assumes that the lane holding element ``i`` of a ``[32 * warps, 4]`` tensor is ``i % 32`` of warp
``i // 32`` (Triton's blocked layout for those loads); the H200 checks compare the result with a float64
reference. The interpreter cannot run PTX: there (``ASM`` off) :func:`_fragment_products_emulated` computes
what the ``mma`` instructions would from the same registers, lane by lane, which checks the slot mapping.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.elementwise_kernels import gated_product
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_kernels import _NOT_GATED
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait


def _fragment_asm(float_bits: int, ones: int, kind: str) -> str:
    """PTX for one lane's 128-column chunk: ``$0..$3`` the ``mma`` accumulators of ``(128 + code) * x``,
    ``$4..$7`` those of the activations' sums; inputs ``$8..$11`` words of row ``g``, ``$12..$15`` of row ``g + 8``,
    ``$16..$23`` bf16 pairs of the low columns, ``$24..$31`` of the high ones."""
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines = [".reg .b32 a0, a1, a2, a3, b0, b1, w, v, one;", f"mov.b32 one, {ones:#010x};"]
    lines += [f"mov.b32 ${i}, 0;" for i in range(8)]
    for u in range(4):
        for shift, select in ((0, "0x5410"), (8, "0x7632")):
            # bytes 0 and 2 (shift 0) or 1 and 3 (shift 8): low nibbles pair with the low columns' activations
            for reg, src, extra in (("a0", 8, 0), ("a1", 12, 0), ("a2", 8, 4), ("a3", 12, 4)):
                if shift + extra:
                    tmp = "w" if src == 8 else "v"
                    lines.append(f"shr.b32 {tmp}, ${src + u}, {shift + extra};")
                    lines.append(f"lop3.b32 {reg}, {tmp}, 0x000F000F, {float_bits:#010x}, 0xEA;")
                else:
                    lines.append(f"lop3.b32 {reg}, ${src + u}, 0x000F000F, {float_bits:#010x}, 0xEA;")
            lines.append(f"prmt.b32 b0, ${16 + 2 * u}, ${17 + 2 * u}, {select};")
            lines.append(f"prmt.b32 b1, ${24 + 2 * u}, ${25 + 2 * u}, {select};")
            lines.append(f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};")
            lines.append(f"{mma} {{$4, $5, $6, $7}}, {{one, one, one, one}}, {{b0, b1}}, {{$4, $5, $6, $7}};")
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_BF16 = tl.constexpr(_fragment_asm(0x43004300, 0x3F803F80, "bf16"))
_ASM_FP16 = tl.constexpr(_fragment_asm(0x64006400, 0x3C003C00, "f16"))
#: eight float32 outputs, 24 int32 inputs (four registers of each of six tensors)
_CONSTRAINTS = tl.constexpr("=r," * 8 + ",".join(["r"] * 24))


@triton.jit
def _halves(pairs, FP16: tl.constexpr):
    """float32 of the low and high 16-bit floats of int32 ``pairs``."""
    if FP16:
        lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((pairs >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _fragment_products_emulated(wg, wh, xl0, xl1, xh0, xh1, WARPS: tl.constexpr, BASE: tl.constexpr,
                                FP16: tl.constexpr):  # fmt: skip
    """What :func:`_fragment_asm`'s instructions compute, from the same per-lane registers ``[32 * WARPS, 4]``:
    lane ``(g, t)``'s accumulators ``(row g, n 2t)``, ``(g, 2t + 1)``, ``(g + 8, 2t)``, ``(g + 8, 2t + 1)`` sum the
    slot products of every lane ``(g, t')``'s codes with lane ``(n, t')``'s activations."""
    LANES: tl.constexpr = 32 * WARPS
    # a lane's slots [4 words, 8]: per word, the first mma's (bytes 0 and 2, low then high nibbles) then the
    # second's (bytes 1 and 3)
    shifts = tl.arange(0, 8)
    nib = tl.where(shifts < 4, 0, 8) + tl.where(shifts % 2 == 1, 16, 0) + tl.where(shifts % 4 >= 2, 4, 0)
    code_g = (((wg[:, :, None] >> nib[None, None, :]) & 0xF) + BASE).to(tl.float32)
    code_h = (((wh[:, :, None] >> nib[None, None, :]) & 0xF) + BASE).to(tl.float32)
    # activations of the same slots: word u's low-column pairs are xl registers 2u, 2u + 1 (x[c], x[c+1]),
    # (x[c+2], x[c+3]); slot order x[c], x[c+2], x[c+64], x[c+66], x[c+1], x[c+3], x[c+65], x[c+67]
    l0a, l0b = _halves(xl0, FP16)
    l1a, l1b = _halves(xl1, FP16)
    h0a, h0b = _halves(xh0, FP16)
    h1a, h1b = _halves(xh1, FP16)
    la = tl.reshape(tl.join(l0a, l1a), (LANES, 2, 2, 2))  # [lane, reg j (u % 2, p), word half u // 2] ...
    lb = tl.reshape(tl.join(l0b, l1b), (LANES, 2, 2, 2))
    ha = tl.reshape(tl.join(h0a, h1a), (LANES, 2, 2, 2))
    hb = tl.reshape(tl.join(h0b, h1b), (LANES, 2, 2, 2))
    # la[lane, u % 2, p, u // 2]: to [lane, u, p]
    la = tl.reshape(tl.permute(la, (0, 3, 1, 2)), (LANES, 4, 2))
    lb = tl.reshape(tl.permute(lb, (0, 3, 1, 2)), (LANES, 4, 2))
    ha = tl.reshape(tl.permute(ha, (0, 3, 1, 2)), (LANES, 4, 2))
    hb = tl.reshape(tl.permute(hb, (0, 3, 1, 2)), (LANES, 4, 2))
    # slots: (la p0, la p1, ha p0, ha p1) then (lb p0, lb p1, hb p0, hb p1)
    first = tl.reshape(tl.permute(tl.join(la, ha), (0, 1, 3, 2)), (LANES, 4, 4))
    second = tl.reshape(tl.permute(tl.join(lb, hb), (0, 1, 3, 2)), (LANES, 4, 4))
    acts = tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), (LANES, 4, 8))
    # [warp, g, t', slots] against [warp, n, t', slots]
    a_g = tl.reshape(code_g, (WARPS, 8, 1, 128))
    a_h = tl.reshape(code_h, (WARPS, 8, 1, 128))
    b = tl.reshape(acts, (WARPS, 1, 8, 128))
    d_g = tl.sum(a_g * b, axis=3)  # [warp, g, n]
    d_h = tl.sum(a_h * b, axis=3)
    s = tl.sum(b, axis=3)  # [warp, 1, n]
    # lane (g, t), register j: row g + 8 (j // 2), n = 2t + j % 2
    c = tl.reshape(tl.join(tl.reshape(d_g, (WARPS, 8, 4, 2)), tl.reshape(d_h, (WARPS, 8, 4, 2))), (WARPS, 8, 4, 2, 2))
    c = tl.reshape(tl.permute(c, (0, 1, 2, 4, 3)), (LANES, 4))
    s4 = tl.broadcast_to(tl.reshape(s, (WARPS, 1, 4, 2)), (WARPS, 8, 4, 2))
    s4 = tl.reshape(tl.join(s4, s4), (WARPS, 8, 4, 2, 2))
    s4 = tl.reshape(tl.permute(s4, (0, 1, 2, 4, 3)), (LANES, 4))
    return c, s4


#: what the chunk loads give past the last chunk (``PAST``): every chunk they read is real, zeros, or anything
#: (a read-ahead whose values are never used: the last chunk again, without the zeros and predicates of a mask)
ALL_REAL: tl.constexpr = tl.constexpr(0)
ZEROS: tl.constexpr = tl.constexpr(1)
UNUSED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _masked(ptrs, ok, PAST: tl.constexpr):
    if PAST == ZEROS:
        return tl.load(ptrs, mask=ok, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _x_pairs(x_row, perm_ptr, cols, ok, HAS_PERM: tl.constexpr, PAST: tl.constexpr):
    """int32 ``[LANES, 4]``: the 16-bit floats of columns ``cols + 2j`` (low half) and ``cols + 2j + 1`` (high
    half) of the activation row at ``x_row`` (``x[perm[..]]`` with ``HAS_PERM``), past the last chunk (not
    ``ok``) as ``PAST`` says."""
    j = tl.arange(0, 4)[None, :]
    if HAS_PERM:
        # past the last chunk the columns are 0 (a real address), whatever PAST says
        c0 = _masked(perm_ptr + cols[:, None] + 2 * j, ok[:, None], ALL_REAL if PAST == ALL_REAL else ZEROS)
        c1 = _masked(perm_ptr + cols[:, None] + 2 * j + 1, ok[:, None], ALL_REAL if PAST == ALL_REAL else ZEROS)
        lo = tl.load(x_row[:, None] + c0).to(tl.int16, bitcast=True)
        hi = tl.load(x_row[:, None] + c1).to(tl.int16, bitcast=True)
        return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)
    else:
        # cols is even: the pairs are whole 32-bit words
        x32 = x_row.to(tl.pointer_type(tl.int32))
        return _masked(x32[:, None] + (cols // 2)[:, None] + j, ok[:, None], PAST)


@triton.jit
def _chunk_words(w32, row_g, row_h, stride_w, words, warp, c0, NUM_CHUNKS: tl.constexpr, PAST: tl.constexpr):
    """The lanes' words ``[LANES, 4]`` of rows ``g`` and ``g + 8`` in chunk ``c0 + warp`` (past the last chunk as
    ``PAST`` says)."""
    ok = (c0 + warp < NUM_CHUNKS)[:, None]
    if PAST == UNUSED:
        c0 = tl.minimum(c0 + warp, NUM_CHUNKS - 1) - warp
    offs = (words + 16 * c0)[:, None] + tl.arange(0, 4)[None, :]
    return _masked(w32 + row_g[:, None] * stride_w + offs, ok, PAST), _masked(w32 + row_h[:, None] * stride_w + offs,
                                                                                ok, PAST)  # fmt: skip


@triton.jit
def _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr, PAST: tl.constexpr):  # fmt: skip
    """float32 group scales (and zero scales; the scales again without) ``[LANES, 4]`` of the lanes' rows
    ``row_j`` in chunk ``chunk`` ``[LANES]`` (past the last chunk as ``PAST`` says)."""
    ok = (chunk < NUM_CHUNKS)[:, None]
    if PAST == UNUSED:
        chunk = tl.minimum(chunk, NUM_CHUNKS - 1)
    group = ((chunk // PER_BLOCK) * BLOCK // GROUP)[:, None]
    scale = _masked(scale_ptr + row_j * stride_sn + group, ok, PAST).to(tl.float32)
    zs = scale
    if HAS_ZS:
        zs = _masked(zs_ptr + row_j * stride_sn + group, ok, ZEROS if PAST == ALL_REAL else PAST).to(tl.float32)
    return scale, zs


@triton.jit
def _chunk_x(x_row, perm_ptr, chunk, t, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
             HAS_PERM: tl.constexpr, PAST: tl.constexpr):  # fmt: skip
    """The four registers of activation pairs ``[LANES, 4]`` each of chunk ``chunk`` ``[LANES]``: lane ``t``'s low
    columns are ``16 t .. 16 t + 15`` of the chunk's 64 within its block, its high ones ``BLOCK / 2`` on."""
    ok = chunk < NUM_CHUNKS
    if PAST == UNUSED:
        chunk = tl.minimum(chunk, NUM_CHUNKS - 1)
    if PER_BLOCK == 1:
        cols = chunk * BLOCK + 16 * t
    else:
        cols = (chunk // PER_BLOCK) * BLOCK + (chunk % PER_BLOCK) * 64 + 16 * t
    xl0 = _x_pairs(x_row, perm_ptr, cols, ok, HAS_PERM, PAST)
    xl1 = _x_pairs(x_row, perm_ptr, cols + 8, ok, HAS_PERM, PAST)
    xh0 = _x_pairs(x_row, perm_ptr, cols + BLOCK // 2, ok, HAS_PERM, PAST)
    xh1 = _x_pairs(x_row, perm_ptr, cols + BLOCK // 2 + 8, ok, HAS_PERM, PAST)
    return xl0, xl1, xh0, xh1


@triton.jit
def _chunk_products(wg, wh, xl0, xl1, xh0, xh1, WARPS: tl.constexpr, BASE: tl.constexpr, FP16: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """A chunk's ``mma`` accumulators ``[LANES, 4]``: of ``(BASE + code) * x``, and of the activations' sums."""
    if ASM:
        if FP16:
            c, s = tl.inline_asm_elementwise(
                asm=_ASM_FP16, constraints=_CONSTRAINTS, args=[wg, wh, xl0, xl1, xh0, xh1],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            c, s = tl.inline_asm_elementwise(
                asm=_ASM_BF16, constraints=_CONSTRAINTS, args=[wg, wh, xl0, xl1, xh0, xh1],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
            )  # fmt: skip
    else:
        c, s = _fragment_products_emulated(wg, wh, xl0, xl1, xh0, xh1, WARPS, BASE, FP16)
    return c, s


@triton.jit
def _staged_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr, zs_ptr,
                   stride_sn, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                   GROUP: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, NOW: tl.constexpr,
                   WARPS: tl.constexpr, BASE: tl.constexpr, OFFSET: tl.constexpr, FP16: tl.constexpr,
                   ASM: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """The kernel's reduction with Triton's pipeliner holding ``STAGES - 1`` chunks in flight a warp as
    ``cp.async`` copies through shared memory (no registers held for them); the first chunk's words are read
    before the PDL wait."""
    wg, wh = _chunk_words(w32, row_g, row_h, stride_w, words, warp, 0, NUM_CHUNKS, NOW)
    if USE_PDL:
        gdc_wait()
    acc = _chunk_step(acc, wg, wh, warp, row_j, t, x_row, perm_ptr, scale_ptr, zs_ptr, stride_sn, NUM_CHUNKS,
                      PER_BLOCK, BLOCK, GROUP, HAS_ZS, HAS_PERM, NOW, WARPS, BASE, OFFSET, FP16, ASM)  # fmt: skip
    for c0 in tl.range(WARPS, NUM_CHUNKS, WARPS, num_stages=STAGES):
        wg, wh = _chunk_words(w32, row_g, row_h, stride_w, words, warp, c0, NUM_CHUNKS, NOW)
        acc = _chunk_step(acc, wg, wh, c0 + warp, row_j, t, x_row, perm_ptr, scale_ptr, zs_ptr, stride_sn,
                          NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS, HAS_PERM, NOW, WARPS, BASE, OFFSET, FP16,
                          ASM)  # fmt: skip
    return acc


@triton.jit
def _chunk_step(acc, wg, wh, chunk, row_j, t, x_row, perm_ptr, scale_ptr, zs_ptr, stride_sn, NUM_CHUNKS: tl.constexpr,
                PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_ZS: tl.constexpr,
                HAS_PERM: tl.constexpr, NOW: tl.constexpr, WARPS: tl.constexpr, BASE: tl.constexpr,
                OFFSET: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """``acc`` plus chunk ``chunk``'s scaled products, given its words ``wg`` / ``wh``."""
    xl0, xl1, xh0, xh1 = _chunk_x(x_row, perm_ptr, chunk, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM, NOW)
    c, s = _chunk_products(wg, wh, xl0, xl1, xh0, xh1, WARPS, BASE, FP16, ASM)
    sc, zc = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS,
                           NOW)  # fmt: skip
    acc += sc * (c - OFFSET * s)
    if HAS_ZS:
        acc -= zc * s
    return acc


@triton.jit
def _read_ahead_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr, zs_ptr,
                       stride_sn, NUM_CHUNKS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                       GROUP: tl.constexpr, HAS_ZS: tl.constexpr, HAS_PERM: tl.constexpr, NOW: tl.constexpr,
                       LATER: tl.constexpr, WARPS: tl.constexpr, BASE: tl.constexpr, OFFSET: tl.constexpr,
                       FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, DEPTH: tl.constexpr,
                       AHEAD: tl.constexpr):  # fmt: skip
    """The kernel's reduction with each warp's words read ``DEPTH`` iterations ahead in registers (with
    ``AHEAD`` their scales too, the activations one iteration ahead)."""
    # the weight is constant: the first DEPTH iterations' words (and with AHEAD their scales) are read before
    # the wait for x (why DEPTH: the module's docstring)
    wg, wh = _chunk_words(w32, row_g, row_h, stride_w, words, warp, 0, NUM_CHUNKS, NOW)
    wg1, wh1, wg2, wh2 = wg, wh, wg, wh
    if DEPTH > 1:
        wg1, wh1 = _chunk_words(w32, row_g, row_h, stride_w, words, warp, WARPS, NUM_CHUNKS, LATER)
    if DEPTH > 2:
        wg2, wh2 = _chunk_words(w32, row_g, row_h, stride_w, words, warp, 2 * WARPS, NUM_CHUNKS, LATER)
    if AHEAD:
        sc, zc = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS,
                               NOW)  # fmt: skip
        sc1, zc1, sc2, zc2 = sc, zc, sc, zc
    if AHEAD and DEPTH > 1:
        sc1, zc1 = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp + WARPS, NUM_CHUNKS, PER_BLOCK, BLOCK,
                                 GROUP, HAS_ZS, LATER)  # fmt: skip
    if AHEAD and DEPTH > 2:
        sc2, zc2 = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, warp + 2 * WARPS, NUM_CHUNKS, PER_BLOCK, BLOCK,
                                 GROUP, HAS_ZS, LATER)  # fmt: skip
    if USE_PDL:
        gdc_wait()
    if AHEAD:
        xl0, xl1, xh0, xh1 = _chunk_x(x_row, perm_ptr, warp, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM, NOW)
    for c0 in range(0, NUM_CHUNKS, WARPS):
        chunk = c0 + warp
        wg_next, wh_next = _chunk_words(w32, row_g, row_h, stride_w, words, warp, c0 + DEPTH * WARPS, NUM_CHUNKS,
                                        LATER)  # fmt: skip
        if AHEAD:
            # without it ptxas issues the scales' loads amid the iteration that multiplies by them and the
            # activations' at its top: a memory latency each, every iteration
            sc_next, zc_next = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk + DEPTH * WARPS, NUM_CHUNKS,
                                             PER_BLOCK, BLOCK, GROUP, HAS_ZS, LATER)  # fmt: skip
            xn0, xn1, xn2, xn3 = _chunk_x(x_row, perm_ptr, chunk + WARPS, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM,
                                          LATER)  # fmt: skip
        else:
            xl0, xl1, xh0, xh1 = _chunk_x(x_row, perm_ptr, chunk, t, NUM_CHUNKS, PER_BLOCK, BLOCK, HAS_PERM, NOW)
        c, s = _chunk_products(wg, wh, xl0, xl1, xh0, xh1, WARPS, BASE, FP16, ASM)
        if not AHEAD:
            sc, zc = _chunk_scales(scale_ptr, zs_ptr, row_j, stride_sn, chunk, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP,
                                   HAS_ZS, NOW)  # fmt: skip
        acc += sc * (c - OFFSET * s)
        if HAS_ZS:
            acc -= zc * s
        if DEPTH == 1:
            wg, wh = wg_next, wh_next
        elif DEPTH == 2:
            wg, wh, wg1, wh1 = wg1, wh1, wg_next, wh_next
        else:
            wg, wh, wg1, wh1, wg2, wh2 = wg1, wh1, wg2, wh2, wg_next, wh_next
        if AHEAD:
            xl0, xl1, xh0, xh1 = xn0, xn1, xn2, xn3
            if DEPTH == 1:
                sc, zc = sc_next, zc_next
            elif DEPTH == 2:
                sc, zc, sc1, zc1 = sc1, zc1, sc_next, zc_next
            else:
                sc, zc, sc1, zc1, sc2, zc2 = sc1, zc1, sc2, zc2, sc_next, zc_next
    return acc


@triton.jit
def grouped_int4_fragment_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om,
    NUM_CHUNKS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, WARPS: tl.constexpr,
    FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, DEPTH: tl.constexpr = 1,
    AHEAD: tl.constexpr = False, GATED: tl.constexpr = -1, STAGES: tl.constexpr = 0,
):  # fmt: skip
    """``out[m, n]`` for the program's 16 output features ``n`` and the ``M <= 8`` activation rows; or, with
    ``GATED`` (an activation of :func:`.elementwise_kernels.gated_product`), ``act(gate) * up`` of 8 features
    ``f`` whose gate rows ``f`` and up rows ``N / 2 + f`` the weight stacks (``out``: ``[M, N / 2]``), the lanes
    holding gate and up rows where a plain product holds rows ``g`` and ``g + 8``: one launch, no round trip.

    ``x``: ``[M, K]`` bf16 (fp16 with ``FP16``), rows ``stride_xm`` apart (even), 4-byte aligned; ``w``, ``scale``,
    ``zs``, ``perm``, ``bias`` as for :func:`~.grouped_int_kernels.grouped_int_gemm_kernel` (``BLOCK`` a multiple
    of 128, ``stride_wn`` a multiple of 16 bytes); ``out``: ``[M, N]`` in its dtype. ``WARPS`` must be the launch's
    ``num_warps``; ``NUM_CHUNKS`` is ``K / 128``. ``DEPTH`` (1-3): how many iterations ahead a warp reads
    its chunks' words. ``AHEAD``: their group scales too, and the activations one iteration ahead. ``STAGES``
    (2 or more): Triton's pipeliner keeps the chunks in flight instead (``DEPTH`` and ``AHEAD`` unread).
    """
    tl.static_assert(DEPTH >= 1 and DEPTH <= 3, "the fragment kernel reads words 1 to 3 iterations ahead")
    LANES: tl.constexpr = 32 * WARPS
    BASE: tl.constexpr = 1024 if FP16 else 128
    # the codes come as BASE + code: the offset (zero point, or BASE alone with zero scales) off the sums
    OFFSET: tl.constexpr = BASE + (0 if HAS_ZS else ZERO)
    PER_BLOCK: tl.constexpr = BLOCK // 128
    EVEN: tl.constexpr = NUM_CHUNKS % WARPS == 0
    # loads of the iteration's own chunk, and of chunks read ahead (past the last one with AHEAD, unused)
    NOW: tl.constexpr = ALL_REAL if EVEN else ZEROS
    LATER: tl.constexpr = UNUSED if AHEAD and EVEN else ZEROS
    lane = tl.arange(0, LANES)
    warp = lane // 32
    g = (lane % 32) // 4
    t = lane % 4
    j = tl.arange(0, 4)[None, :]
    if GATED == _NOT_GATED:
        row0 = tl.program_id(0) * 16
        row_g = tl.minimum(row0 + g, N - 1).to(tl.int64)
        row_h = tl.minimum(row0 + g + 8, N - 1).to(tl.int64)
    else:
        row0 = tl.program_id(0) * 8
        row_g = tl.minimum(row0 + g, N // 2 - 1).to(tl.int64)
        row_h = row_g + N // 2
    # registers j = 0, 1 hold row g's sums, 2, 3 row h's
    row_j = tl.where(j // 2 == 0, row_g[:, None], row_h[:, None])
    w32 = w_ptr.to(tl.pointer_type(tl.int32))
    stride_w = stride_wn // 4
    words = 16 * warp + 4 * t  # this lane's words in chunk 0 (each chunk 16 words a row)
    # lane g holds activation row g as the mma's column g: lanes past M read row M - 1 into columns whose
    # sums are never stored (a column of the product depends on its own column of activations alone)
    x_row = x_ptr + tl.minimum(g, M - 1) * stride_xm
    acc = tl.zeros((LANES, 4), dtype=tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    if STAGES > 0:
        acc = _staged_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr,
                             zs_ptr, stride_sn, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS, HAS_PERM, NOW, WARPS, BASE,
                             OFFSET, FP16, ASM, USE_PDL, STAGES)  # fmt: skip
    else:
        acc = _read_ahead_chunks(acc, w32, row_g, row_h, row_j, stride_w, words, warp, t, x_row, perm_ptr, scale_ptr,
                                 zs_ptr, stride_sn, NUM_CHUNKS, PER_BLOCK, BLOCK, GROUP, HAS_ZS, HAS_PERM, NOW, LATER,
                                 WARPS, BASE, OFFSET, FP16, ASM, USE_PDL, DEPTH, AHEAD)  # fmt: skip
    total = tl.sum(tl.reshape(acc, (WARPS, 32, 4)), axis=0)
    lane32 = tl.arange(0, 32)[:, None]
    if GATED == _NOT_GATED:
        n_out = 2 * (lane32 % 4) + j % 2
        feature = row0 + lane32 // 4 + 8 * (j // 2)
        store_ok = (n_out < M) & (feature < N)
        if HAS_BIAS:
            total += tl.load(bias_ptr + feature, mask=feature < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n_out.to(tl.int64) * stride_om + feature, total.to(out_ptr.dtype.element_ty),
                 mask=store_ok)  # fmt: skip
    else:
        tl.static_assert(not HAS_BIAS, "a gated product takes no bias")
        half = N // 2
        feature = row0 + lane32 // 4
        # [lane, j] as [lane, j % 2, j // 2]: the gate's sums (j // 2 == 0) beside the up rows'
        gate, up = tl.split(tl.permute(tl.reshape(total, (32, 2, 2)), (0, 2, 1)))
        n_out = 2 * (lane32 % 4) + tl.arange(0, 2)[None, :]
        store_ok = (n_out < M) & (feature < half)
        tl.store(out_ptr + n_out.to(tl.int64) * stride_om + feature,
                 gated_product(gate, up, GATED).to(out_ptr.dtype.element_ty), mask=store_ok)  # fmt: skip
