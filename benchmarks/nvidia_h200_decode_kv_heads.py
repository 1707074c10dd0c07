"""Decode attention with one or two KV heads a program (``KernelTuning.decode_paired_fp8``), through the engine's
launcher as a decode step runs it (the step's keys and values written by the kernel, rotary fused), over FP8 and
bf16 caches; each variant timed from CUDA graphs, its output checked against one head a program.

Usage (repo root, on the device): python benchmarks/nvidia_h200_decode_kv_heads.py [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from nvidia_h200_fp8 import _median_seconds  # noqa: E402

#: (num_seqs, context): the offline run's decode steps (1,000 x ~560), a long-context batch, a mid-size one
SHAPES = ((1008, 560), (256, 2048), (64, 1024))
#: paired-program tiles tried: (block_n, num_warps, num_stages)
PAIRED_TILES = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2))


# a stripped decode kernel (no KV write, no rotary, no splits, query pre-scaled, products accumulated in place),
# one or two (KVH) KV heads a program: what the engine's kernel is measured against in ``--ladder``
@triton.jit
def probe_kernel(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, scale,
       s_q_tok, s_q_head, s_o_tok, s_o_head, s_bt, s_slot, s_head,
       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, KVB: tl.constexpr, BN: tl.constexpr,
       KVH: tl.constexpr):
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    n = tl.load(lens_ptr + seq)
    og = tl.arange(0, GP)
    od = tl.arange(0, D)
    on = tl.arange(0, BN)
    h0 = kvh * KVH
    heads = h0 * G + og
    gok = og < KVH * G
    rh = og // G
    row = seq.to(tl.int64)
    q = tl.load(q_ptr + row * s_q_tok + heads[:, None] * s_q_head + od[None, :], mask=gok[:, None], other=0.0)
    q16 = (q.to(tl.float32) * (scale * 1.4426950408889634)).to(tl.float16)
    q0 = tl.where(rh[:, None] == 0, q16, 0.0)
    q1 = tl.where(rh[:, None] == 1, q16, 0.0)
    q2 = tl.where(rh[:, None] == 2, q16, 0.0)
    q3 = tl.where(rh[:, None] == 3, q16, 0.0)
    m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    bt = bt_ptr + row * s_bt
    for start in range(0, n, BN):
        offs = start + on
        valid = offs < n
        blk = tl.load(bt + offs // KVB, mask=valid, other=0).to(tl.int64)
        slot = blk * KVB + offs % KVB
        ptrs = slot[:, None] * s_slot + h0 * s_head + od[None, :]
        k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
        if KVH == 1:
            qk = tl.dot(q16, tl.trans(k.to(tl.float16)))
        else:
            qk = tl.dot(q0, tl.trans(k.to(tl.float16)))
            k1 = tl.load(k_ptr + ptrs + s_head, mask=valid[:, None], other=0.0)
            qk = tl.dot(q1, tl.trans(k1.to(tl.float16)), qk)
            if KVH == 4:
                k2 = tl.load(k_ptr + ptrs + 2 * s_head, mask=valid[:, None], other=0.0)
                qk = tl.dot(q2, tl.trans(k2.to(tl.float16)), qk)
                k3 = tl.load(k_ptr + ptrs + 3 * s_head, mask=valid[:, None], other=0.0)
                qk = tl.dot(q3, tl.trans(k3.to(tl.float16)), qk)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
        if KVH == 1:
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
        else:
            acc = tl.dot(tl.where(rh[:, None] == 0, p, 0.0).to(tl.float16), v.to(tl.float16), acc)
            v1 = tl.load(v_ptr + ptrs + s_head, mask=valid[:, None], other=0.0)
            acc = tl.dot(tl.where(rh[:, None] == 1, p, 0.0).to(tl.float16), v1.to(tl.float16), acc)
            if KVH == 4:
                v2 = tl.load(v_ptr + ptrs + 2 * s_head, mask=valid[:, None], other=0.0)
                acc = tl.dot(tl.where(rh[:, None] == 2, p, 0.0).to(tl.float16), v2.to(tl.float16), acc)
                v3 = tl.load(v_ptr + ptrs + 3 * s_head, mask=valid[:, None], other=0.0)
                acc = tl.dot(tl.where(rh[:, None] == 3, p, 0.0).to(tl.float16), v3.to(tl.float16), acc)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + row * s_o_tok + heads[:, None] * s_o_head + od[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gok[:, None])



@dataclasses.dataclass
class DecodeStep:
    """A decode step's attention inputs: ``num_seqs`` contexts of ``ctx`` tokens in a shuffled block pool, the
    step's query, key and value, their slots and rotation, and an FP8 cache over the pool."""

    num_seqs: int
    ctx: int
    tables: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    cache: torch.Tensor

    @classmethod
    def draw(cls, num_seqs: int, ctx: int, heads: int = 32, kv_heads: int = 8, dim: int = 128,
             block: int = 16) -> DecodeStep:  # fmt: skip
        from engine_plugin_sdk.reference_ops import make_cos_sin_cache

        per_seq = -(-ctx // block)
        num_blocks = num_seqs * per_seq
        tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).reshape(num_seqs, per_seq)
        lens = torch.full((num_seqs,), ctx, device="cuda", dtype=torch.int32)
        slots = (tables[:, (ctx - 1) // block].long() * block + (ctx - 1) % block).contiguous()
        rows = [torch.randn(num_seqs, n, dim, device="cuda", dtype=torch.bfloat16) for n in (heads, kv_heads, kv_heads)]
        rotary = ((lens - 1).long(), make_cos_sin_cache(4096, dim).cuda())
        cache = (torch.randn(2, num_blocks, block, kv_heads, dim, device="cuda") * 2).to(torch.float8_e4m3fn)
        return cls(num_seqs, ctx, tables, lens, slots, *rows, rotary, cache)


def ladder(before: str | None, quick: bool = False) -> list[dict]:
    """At the offline run's decode shape over an FP8 cache: the engine's kernel with and without its fused KV
    write and rotary, by tile, one and two KV heads a program, beside the stripped probe kernel."""
    from engine_plugin_nvidia.tuning import tuning_for_device
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    heads, kv_heads, dim, block = 32, 8, 128, 16
    step = DecodeStep.draw(1008, 560)
    num_seqs, ctx, tables, lens, slots = step.num_seqs, step.ctx, step.tables, step.lens, step.slots
    query, key, value, rotary, cache = step.query, step.key, step.value, step.rotary, step.cache
    cache_bytes = num_seqs * ctx * kv_heads * dim * 2
    base = dataclasses.replace(tuning_for_device(False), decode_paired_fp8=None)
    rows = []

    def timed(name: str, fn) -> None:
        seconds = _median_seconds(fn)
        rows.append({"variant": name, "ms": seconds * 1e3, "tb_s": cache_bytes / seconds / 1e12})
        print(f"ladder {name:52s} {seconds * 1e3:7.3f} ms {cache_bytes / seconds / 1e12:5.2f} TB/s", flush=True)

    if before:
        # the earlier commit's kernel (nvidia_h200.py --decode-kernel-from) at the default tiles, then this one's
        import nvidia_h200

        current = launchers.dak
        nvidia_h200.use_decode_kernel_from(before)
        for fused in (True, False)[:1 if quick else 2]:
            extra = {"new_kv": (key, value, slots), "rotary": rotary} if fused else {}
            out = torch.empty_like(query)
            timed(f"before {'write+rotary' if fused else 'plain'}",
                  functools.partial(launchers.paged_decode, out, query, cache, tables, lens, dim**-0.5, 1, base, **extra))
        launchers.dak = current
    for tiles in ((128, 4, 2), (64, 4, 3), (64, 4, 2)):
        for paired in (False, True):
            t = dataclasses.replace(base, decode_fp8=tiles, decode_paired_fp8=tiles if paired else None)
            for fused in (True, False)[:1 if quick else 2]:
                extra = {"new_kv": (key, value, slots), "rotary": rotary} if fused else {}
                out = torch.empty_like(query)
                timed(f"engine {tiles} {'two heads' if paired else 'one head'} {'write+rotary' if fused else 'plain'}",
                      functools.partial(launchers.paged_decode, out, query, cache, tables, lens, dim**-0.5, 1, t,
                                        **extra))  # fmt: skip
        for kvh in (1, 2)[1 if quick else 0:]:
            out = torch.empty_like(query)
            bn, warps, stages = tiles
            timed(f"probe {tiles} kvh {kvh}", functools.partial(
                probe_kernel[(kv_heads // kvh, num_seqs)], out, query, cache[0], cache[1], tables, lens, dim**-0.5,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1), tables.stride(0), cache.stride(2),
                cache.stride(3), G=heads // kv_heads, GP=16, D=dim, KVB=block, BN=bn, KVH=kvh, num_warps=warps,
                num_stages=stages))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--ladder", action="store_true", help="only the FP8 ladder at 1,008 x 560 (see ladder)")
    parser.add_argument("--quick", action="store_true", help="with --ladder: the fused kernels only, fewer probes")
    parser.add_argument("--before", default=None, help="with --ladder: an earlier commit's kernel module to time too")
    args = parser.parse_args()
    if args.ladder:
        rows = ladder(args.before, args.quick)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0), "ladder": rows}, f, indent=1)
        return
    from engine_plugin_nvidia.tuning import tuning_for_device
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    base = dataclasses.replace(tuning_for_device(False), decode_paired_fp8=None)
    heads, kv_heads, dim, block = 32, 8, 128, 16
    torch.manual_seed(0)
    rows = []
    for num_seqs, ctx in SHAPES:
        step = DecodeStep.draw(num_seqs, ctx, heads, kv_heads, dim, block)
        tables, lens, slots, query, key, value = step.tables, step.lens, step.slots, step.query, step.key, step.value
        rotary, fp8 = step.rotary, step.cache
        for cache in (fp8, fp8.to(torch.bfloat16)):
            cache_bytes = num_seqs * ctx * kv_heads * dim * 2 * cache.element_size()
            variants = [("one head", base)] + [
                (f"two heads {t}", dataclasses.replace(base, decode_paired_fp8=t, decode_paired_any_cache=True))
                for t in PAIRED_TILES
            ]
            reference = None
            for name, tuning in variants:
                out = torch.empty_like(query)
                splits = tuning.decode_splits(num_seqs, kv_heads, None)
                fn = functools.partial(launchers.paged_decode, out, query, cache, tables, lens, dim**-0.5, splits,
                                       tuning, new_kv=(key, value, slots), rotary=rotary)  # fmt: skip
                try:
                    seconds = _median_seconds(fn)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported, the rest go on
                    print(f"{num_seqs}x{ctx} {cache.dtype} {name}: FAILED {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                fn()
                torch.cuda.synchronize()
                if reference is None:
                    reference = out.float().clone()
                err = (out.float() - reference).abs().max().item()
                paired = tuning.decode_kv_heads(cache.dtype == torch.float8_e4m3fn, num_seqs, kv_heads, heads // kv_heads)
                row = {"seqs": num_seqs, "context": ctx, "cache": str(cache.dtype), "variant": name,
                       "kv_heads_a_program": paired, "splits": splits, "ms": seconds * 1e3,
                       "tb_s": cache_bytes / seconds / 1e12, "max_diff_vs_one_head": err}  # fmt: skip
                rows.append(row)
                print(f"{num_seqs:5d}x{ctx:<5d} {str(cache.dtype):20s} {name:28s} x{paired} splits {splits:2d}: "
                      f"{seconds * 1e3:7.3f} ms {row['tb_s']:5.2f} TB/s  diff {err:.2e}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
