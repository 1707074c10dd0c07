"""The product of a few activation rows (2 to 16: small-batch decode, speculative verification) with 4-bit
grouped codes on tensor cores: ``out[m, n] = sum_k x[m, perm[k]] * W[n, k] (+ bias[n])``, in the packed layout
of :mod:`.grouped_int_kernels` (byte ``r`` of a block of ``BLOCK`` columns holds column ``r`` in its low
nibble and column ``BLOCK / 2 + r`` in its high one).

Each program dequantizes ``BLOCK_N`` weight rows a block at a time into bf16 / fp16 and multiplies them with the
block's activations, padded to 16 rows (``tl.dot``'s smallest tile): at these batch sizes the tensor cores
do the multiply-adds that a CUDA-core kernel spends most of its instructions on.

On the GPU the codes become floats two at a time in inline PTX (``ASM``): a byte permute puts two adjacent
columns' bytes in the two 16-bit halves of a register, one AND-OR per nibble gives the bf16 ``128 + code``
(fp16: ``1024 + code``) in each half, and one packed fused multiply-add subtracts ``128 + offset``: exact,
about one instruction a code. That relies on Triton handing the asm the 16-bit elements of a tile two at a
time in pairs of adjacent halves of a 32-bit word (a thread holds runs of them); the H200 checks compare the
result with a float64 reference. The interpreter cannot run PTX: there (``ASM`` off) the same tile comes from
plain integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.pdl import pdl_begin


def _decode_asm(float_bits: int, one_bits: int, fma: str) -> str:
    """The PTX that turns 16-bit code pairs ``$4`` (halves ``2u``, ``2u + 1`` of a row's block: its bytes
    ``4u .. 4u + 3``) into ``code - offset`` of columns ``(4u, 4u+1)``, ``(B/2 + 4u, ..)``, ``(4u+2, 4u+3)``,
    ``(B/2 + 4u + 2, ..)`` (``$0 .. $3``, each register two adjacent columns): ``float_bits`` ORed onto a
    nibble make ``base + code``, and ``fma`` with ``one_bits`` adds ``$5`` (``-(base + offset)``)."""
    nibbles = "\n".join(
        f"lop3.b32 ${i}, {src}, 0x000F000F, {float_bits:#010x}, 0xEA;" + ("\nshr.b32 a, a, 4;" if i == 0 else "")
        + ("\nshr.b32 b, b, 4;" if i == 2 else "")
        for i, src in enumerate("aabb")
    )
    adds = "\n".join(f"fma.rn.{fma} ${i}, ${i}, one, $5;" for i in range(4))
    return (
        f"{{\n.reg .b32 a, b, one;\nmov.b32 one, {one_bits:#010x};\nprmt.b32 a, $4, 0, 0x4140;\n"
        f"prmt.b32 b, $4, 0, 0x4342;\n{nibbles}\n{adds}\n}}"
    )


#: bf16 ``128 + code`` (exponent bits of 128, ones 1.0 1.0) and fp16 ``1024 + code``
_ASM_BF16 = tl.constexpr(_decode_asm(0x43004300, 0x3F803F80, "bf16x2"))
_ASM_FP16 = tl.constexpr(_decode_asm(0x64006400, 0x3C003C00, "f16x2"))


@triton.jit
def _pairs(h, sub_bits, FP16: tl.constexpr):
    """Four bf16 (fp16 with ``FP16``) tensors of ``h``'s codes minus the offset: see :func:`_decode_asm`."""
    if FP16:
        return tl.inline_asm_elementwise(asm=_ASM_FP16, constraints="=r,=r,=r,=r,r,r,r", args=[h, sub_bits],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=2)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(asm=_ASM_BF16, constraints="=r,=r,=r,=r,r,r,r", args=[h, sub_bits],
                                         dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)  # fmt: skip


@triton.jit
def _weight_tile(w_ptr, rows, kb, stride_wn, sub_bits, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """``[BLOCK_N, BLOCK]`` ``code - OFFSET`` of block ``kb`` of ``rows``, columns in stored order."""
    if ASM:
        HALVES: tl.constexpr = BLOCK // 4
        w16 = w_ptr.to(tl.pointer_type(tl.uint16))
        h = tl.load(w16 + rows[:, None] * (stride_wn // 2) + kb * HALVES + tl.arange(0, HALVES)[None, :])
        c0, c1, c2, c3 = _pairs(h, sub_bits, FP16)
        # [n, h = 2u + v, i0, i1] holds column BLOCK / 2 * i0 + 4u + 2 i1 + v: reorder to stored order
        tile = tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (BLOCK_N, HALVES // 2, 2, 2, 2))
        return tl.reshape(tl.permute(tile, (0, 3, 1, 4, 2)), (BLOCK_N, BLOCK))
    else:
        codes = tl.load(w_ptr + rows[:, None] * stride_wn + kb * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :])
        both = tl.join((codes & 0xF).to(tl.float32), (codes >> 4).to(tl.float32)) - OFFSET
        tile = tl.reshape(tl.permute(both, (0, 2, 1)), (BLOCK_N, BLOCK))
        return tile.to(tl.float16 if FP16 else tl.bfloat16)


@triton.jit
def grouped_int4_mma_kernel(
    x_ptr, w_ptr, scale_ptr, zs_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_wn, stride_sn, stride_om, stride_os, sub_bits,
    NUM_BLOCKS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZS: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile over split ``pid(1)`` of the reduction's blocks.

    ``x`` holds ``M <= BLOCK_M`` rows in bf16, or fp16 with ``FP16`` (the tile's dtype); ``w``, ``scale``, ``zs``, ``perm``,
    ``bias`` as for :func:`~.grouped_int_gemm_kernels.grouped_int_gemm_kernel`. ``sub_bits``: the 16-bit float
    ``-(128 + offset)`` (fp16: ``-(1024 + offset)``) twice over in an int32, where ``offset`` is ``ZERO``, or 0
    with zero scales. ``out`` is ``[M, N]`` in its dtype, or float32 partial sums ``[SPLIT, M, N]``.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    OFFSET: tl.constexpr = 0 if HAS_ZS else ZERO
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # rows past N read row N - 1 (never stored)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK)
    PER: tl.constexpr = (NUM_BLOCKS + SPLIT - 1) // SPLIT
    first = pid_k * PER
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl_begin(USE_PDL)
    for kb in range(first, tl.minimum(first + PER, NUM_BLOCKS)):
        cols = kb * BLOCK + offs_k
        if HAS_PERM:
            cols = tl.load(perm_ptr + cols)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + cols[:, None], mask=m_ok[None, :], other=0.0)
        group = kb * BLOCK // GROUP
        scale = tl.load(scale_ptr + rows * stride_sn + group).to(tl.float32)
        w = _weight_tile(w_ptr, rows, kb, stride_wn, sub_bits, OFFSET, BLOCK, BLOCK_N, FP16, ASM)
        acc += tl.dot(w, xt) * scale[:, None]
        if HAS_ZS:
            zs = tl.load(zs_ptr + rows * stride_sn + group).to(tl.float32)
            acc -= zs[:, None] * tl.sum(xt.to(tl.float32), axis=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
