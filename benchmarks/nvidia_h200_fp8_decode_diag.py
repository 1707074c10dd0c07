"""Why decode attention over an FP8 KV cache reads at ~2.3 TB/s (diagnostic, H200; see BENCHMARKS.md).

A standalone copy of the decode kernel (one split, no fused KV write, FP8 or bf16 cache) with switches
that remove one piece of per-token work at a time; some give wrong results on purpose, and the max
error against a float64 reference says which. Usage: python benchmarks/nvidia_h200_fp8_decode_diag.py
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from nvidia_h200_fp8 import _median_seconds  # noqa: E402


@triton.jit
def dk(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, scale,
       s_q_tok, s_q_head, s_o_tok, s_o_head, s_bt, s_slot, s_head,
       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, KVB: tl.constexpr, BN: tl.constexpr,
       MODE: tl.constexpr, HEADS_FIRST: tl.constexpr):
    # MODE 0: as the engine (fp16 products); 5: no softmax (p = qk, wrong on purpose); 6: contiguous
    # addressing, no block table; 7: no masks; 8: two KV heads per program (8 real query rows of 16)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    n = tl.load(lens_ptr + seq)
    og = tl.arange(0, GP)
    od = tl.arange(0, D)
    on = tl.arange(0, BN)
    if MODE == 8:
        h0 = kvh * 2
        heads = h0 * G + og
        gok = og < 2 * G
        first = og < G
    else:
        h0 = kvh
        heads = kvh * G + og
        gok = og < G
    row = seq.to(tl.int64)
    q = tl.load(q_ptr + row * s_q_tok + heads[:, None] * s_q_head + od[None, :], mask=gok[:, None], other=0.0)
    q16 = (q.to(tl.float32) * (scale * 1.4426950408889634)).to(tl.float16)
    m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    bt = bt_ptr + row * s_bt
    for start in range(0, n, BN):
        offs = start + on
        valid = offs < n
        if MODE == 6:
            slot = row * 560 + offs
        else:
            blk = tl.load(bt + offs // KVB, mask=valid, other=0).to(tl.int64)
            slot = blk * KVB + offs % KVB
        ptrs = slot[:, None] * s_slot + h0 * s_head + od[None, :]
        if MODE == 7:
            k = tl.load(k_ptr + ptrs)
        else:
            k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
        qk = tl.dot(q16, tl.trans(k.to(tl.float16)))
        if MODE == 8:
            k1 = tl.load(k_ptr + ptrs + s_head, mask=valid[:, None], other=0.0)
            qk = tl.where(first[:, None], qk, tl.dot(q16, tl.trans(k1.to(tl.float16))))
        if MODE == 5:
            p = qk
            alpha = l_i * 0 + 1.0
            m_new = m_i
        else:
            if MODE != 7:
                qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 7:
            v = tl.load(v_ptr + ptrs)
        else:
            v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
        if MODE == 8:
            v1 = tl.load(v_ptr + ptrs + s_head, mask=valid[:, None], other=0.0)
            p0 = tl.where(first[:, None], p, 0.0).to(tl.float16)
            p1 = tl.where(first[:, None], 0.0, p).to(tl.float16)
            pv = tl.dot(p0, v.to(tl.float16)) + tl.dot(p1, v1.to(tl.float16))
        else:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + row * s_o_tok + heads[:, None] * s_o_head + od[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gok[:, None])


def main():
    torch.manual_seed(0)
    heads, kvh, dim, block = 32, 8, 128, 16
    for num_seqs, ctx in [(1008, 560)]:
        bps = -(-ctx // block)
        nb = num_seqs * bps
        perm = torch.randperm(nb, device="cuda").to(torch.int32)
        tables = perm.reshape(num_seqs, bps)
        lens = torch.full((num_seqs,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(num_seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
        cache8 = (torch.randn(2, nb, block, kvh, dim, device="cuda") * 2).to(torch.float8_e4m3fn)
        cache16 = cache8.to(torch.bfloat16)
        cache = cache8
        # fp64 reference on the first 16 sequences
        ref_n = 16
        kk = cache[0][tables[:ref_n].long()].reshape(ref_n, -1, kvh, dim)[:, :ctx].double()
        vv = cache[1][tables[:ref_n].long()].reshape(ref_n, -1, kvh, dim)[:, :ctx].double()
        qq = q[:ref_n].double().reshape(ref_n, kvh, heads // kvh, dim)
        s = torch.einsum("bhgd,bnhd->bhgn", qq, kk) * dim**-0.5
        ref = torch.einsum("bhgn,bnhd->bhgd", s.softmax(-1), vv).reshape(ref_n, heads, dim)
        for mode, cache in [(m, cache8) for m in (0, 5, 6, 7, 8)] + [(0, cache16), (8, cache16)]:
          nbytes = cache.numel() * cache.element_size()
          for bn, warps, stages in (((128, 4, 2), (64, 4, 3), (64, 4, 2)) if cache.dtype != torch.bfloat16 else ((64, 4, 2), (32, 4, 3))):
                for hf in (True,):
                    out = torch.empty_like(q)
                    grid = (kvh // 2 if mode == 8 else kvh, num_seqs)
                    fn = functools.partial(
                        dk[grid], out, q, cache[0], cache[1], tables, lens, dim**-0.5,
                        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
                        cache.stride(2), cache.stride(3), G=heads // kvh, GP=16, D=dim, KVB=block,
                        BN=bn, MODE=mode, HEADS_FIRST=hf, num_warps=warps, num_stages=stages,
                    )  # fmt: skip
                    try:
                        t = _median_seconds(fn)
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
                        print(f"{num_seqs}x{ctx} mode {mode} {bn},{warps},{stages}: FAILED {type(e).__name__}: {str(e)[:200]}")
                        continue
                    err = (out[:ref_n].double() - ref).abs().max().item()
                    print(f"{cache.dtype} {num_seqs}x{ctx} mode {mode} tiles {bn},{warps},{stages}: {t*1e3:.3f} ms "
                          f"{nbytes/t/1e12:.2f} TB/s  max err {err:.4f} (ref max {ref.abs().max().item():.2f})", flush=True)


main()
