"""Probe (measured, not landed): a gated MLP's gate/up and down in one kernel at a few rows.

Each program takes a chunk of one slot's intermediate rows: gate/up GEMV, activation, then the matching columns
of ``down`` times it, added into a float32 sum per token with atomics; the last program of a token writes the
output and clears the sum. Against the plugin's two kernels (one MoE layer of Qwen3-30B-A3B shapes at 1 and 8
tokens, and Llama-3-8B's dense MLP at one row), in CUDA graphs with PDL; then batch-1 MoE decode with it
patched in (``python probe_moe_fused.py TOKENIZER_DIR``).
"""

# ruff: noqa: B023, BLE001, I001

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from nvidia_h200_moe import E, HIDDEN, INTER, TOP_K, timed  # noqa: E402

from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait  # noqa: E402


@triton.jit
def fused_kernel(
    x_ptr, gu_ptr, dn_ptr, ids_ptr, topw_ptr, acc_ptr, cnt_ptr, out_ptr,
    s_gu_e, s_gu_n, s_dn_e, s_dn_h, s_dn_i,
    INTER: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, CONVERT: tl.constexpr,
    PRE_DOWN: tl.constexpr, EARLY: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    slot = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    rows = chunk * BLOCK_I + tl.arange(0, BLOCK_I)
    token = slot // TOP_K
    if EARLY:  # dense: the weights are known before the previous kernel ends
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        gate_rows = gu_ptr + expert * s_gu_e + rows[:, None].to(tl.int64) * s_gu_n
        up_rows = gate_rows + INTER * s_gu_n
        g0 = tl.load(gate_rows + tl.arange(0, BLOCK_K)[None, :])
        u0 = tl.load(up_rows + tl.arange(0, BLOCK_K)[None, :])
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY:
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        gate_rows = gu_ptr + expert * s_gu_e + rows[:, None].to(tl.int64) * s_gu_n
        up_rows = gate_rows + INTER * s_gu_n
    dn_base = dn_ptr + expert * s_dn_e + rows[None, :].to(tl.int64) * s_dn_i
    offs_h0 = tl.arange(0, BLOCK_H)
    d0 = tl.load(dn_base + offs_h0[:, None] * s_dn_h)
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * H + offs_k).to(tl.float32)
        if EARLY and k0 == 0:
            acc_g += g0.to(tl.float32) * x[None, :]
            acc_u += u0.to(tl.float32) * x[None, :]
        else:
            acc_g += tl.load(gate_rows + offs_k[None, :]).to(tl.float32) * x[None, :]
            acc_u += tl.load(up_rows + offs_k[None, :]).to(tl.float32) * x[None, :]
    gate = tl.sum(acc_g, axis=1).to(tl.bfloat16).to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(tl.bfloat16).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16).to(tl.float32)
    act = act * tl.load(topw_ptr + slot)
    for h0 in tl.static_range(0, H, BLOCK_H):
        offs_h = h0 + offs_h0
        if PRE_DOWN and h0 == 0:
            d = d0
        else:
            d = tl.load(dn_base + offs_h[:, None] * s_dn_h)
        part = tl.sum(d.to(tl.float32) * act[None, :], axis=1)
        tl.atomic_add(acc_ptr + token * H + offs_h, part, sem="relaxed")
    if CONVERT:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + token, 1, sem="acq_rel")
        if done == TOP_K * CHUNKS - 1:
            offs = tl.arange(0, H)
            v = tl.load(acc_ptr + token * H + offs, cache_modifier=".cg")
            tl.store(out_ptr + token * H + offs, v.to(out_ptr.dtype.element_ty))
            tl.store(acc_ptr + token * H + offs, tl.zeros([H], dtype=tl.float32))
            tl.store(cnt_ptr + token, 0)


def fused(x, gu, dn, ids, topw, acc, cnt, out, bi, bk, bh, warps, convert=True, pre=False, early=False):
    from engine_plugin_sdk.gpu.triton_kernels import pdl

    tokens, hidden = x.shape
    inter = gu.shape[1] // 2
    top_k = ids.numel() // tokens
    chunks = inter // bi
    fused_kernel[(tokens * top_k, chunks)](
        x, gu, dn, ids, topw, acc, cnt, out, gu.stride(0), gu.stride(1), dn.stride(0), dn.stride(1), dn.stride(2),
        INTER=inter, H=hidden, TOP_K=top_k, CHUNKS=chunks, BLOCK_I=bi, BLOCK_K=bk, BLOCK_H=bh, CONVERT=convert,
        PRE_DOWN=pre, EARLY=early, num_warps=warps, **pdl.launch_options(),
    )
    return out


KEEP = {"hi_i16_k256_h256_w4", "hi_i32_k128_h128_w4", "hi_i32_k128_h128_w8", "ih_i16_k256_h256_w4",
        "ih_i32_k128_h128_w4", "hi_i16_k256_h256_w4_pre"}
KEEP_DENSE = {"ih_i16_k256_h256_w4", "ih_i32_k128_h128_w8", "hi_i64_k64_h64_w8"}


def sweep() -> dict:
    from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles, fused_moe, moe_topk

    gen = torch.Generator(device="cuda").manual_seed(0)
    gu = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    dn_t = dn.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [E, I, H] in memory
    results = {}
    for tokens in (1, 8):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
        logits = torch.randn(tokens, E, device="cuda", generator=gen, dtype=torch.float32)
        topw, ids = moe_topk(logits, TOP_K, True)
        topw, ids = topw.reshape(-1).contiguous(), ids.reshape(-1).contiguous()
        want = fused_moe(x, gu, dn, topw.view(tokens, TOP_K), ids.view(tokens, TOP_K), MoeTiles()).float()
        row = {"base": 1e6 * timed(lambda: fused_moe(x, gu, dn, topw.view(tokens, TOP_K), ids.view(tokens, TOP_K), MoeTiles()))}
        acc = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.float32)
        cnt = torch.zeros(tokens, device="cuda", dtype=torch.int32)
        out = torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for layout, d in (("hi", dn), ("ih", dn_t)):
            for bi in (16, 32, 64):
                for bk in (4096 // bi, 2048 // bi):
                    for bh in (4096 // bi, 2048 // bi):
                        for warps in (4, 8):
                            for pre in ((False, True) if layout == "hi" else (False,)):
                                name = f"{layout}_i{bi}_k{bk}_h{bh}_w{warps}{'_pre' if pre else ''}"
                                if name not in KEEP:
                                    continue
                                try:
                                    got = fused(x, gu, d, ids, topw, acc, cnt, out, bi, bk, bh, warps, pre=pre).float()
                                    err = float(((got - want).abs().max() / want.abs().max()).item())
                                    us = 1e6 * timed(lambda: fused(x, gu, d, ids, topw, acc, cnt, out, bi, bk, bh, warps, pre=pre))
                                except Exception as exc:  # noqa: BLE001 - probe: a tile that does not fit
                                    row[name] = str(exc)[:80]
                                    continue
                                row[name] = (us, err)
        ranked = sorted((v[0], k, v[1]) for k, v in row.items() if isinstance(v, tuple))
        print(f"T={tokens} base {row['base']:.1f} us; best: " + "; ".join(f"{k} {us:.1f} (err {e:.1e})" for us, k, e in ranked[:6]), flush=True)
        results[tokens] = row
    return results


def patch(cfg) -> None:
    """fused_moe at <= 8 tokens (bf16, SiLU, no scales or biases) through the fused kernel; a workspace per layer."""
    from engine_plugin_sdk.gpu.triton_kernels import moe_launchers

    run = moe_launchers.fused_moe
    spaces = {}
    _, bi, bk, bh, warps, pre = cfg

    def patched(x, gu, dn, w, i, tiles, **kw):
        tokens = x.shape[0]
        if tokens > 8 or any(v is not None for k, v in kw.items() if k != "activation") or kw.get("activation", "silu") != "silu":
            return run(x, gu, dn, w, i, tiles, **kw)
        key = gu.data_ptr()
        if key not in spaces:
            spaces[key] = (torch.zeros(8, HIDDEN, device=x.device, dtype=torch.float32),
                           torch.zeros(8, device=x.device, dtype=torch.int32))
        acc, cnt = spaces[key]
        out = torch.empty_like(x)
        return fused(x, gu, dn, i.reshape(-1), w.reshape(-1).float(), acc, cnt, out, bi, bk, bh, warps, pre=pre)

    moe_launchers.fused_moe = patched


def decode(tokenizer: str, cfg) -> dict:
    import tempfile

    from nvidia_h200 import batched_decode_rate, copy_bandwidth, decode_rate, release
    from nvidia_h200_moe import make_moe_llm, moe_model_folder, step_bytes

    from engine_plugin_sdk.gpu.triton_kernels import moe_launchers

    bandwidth = copy_bandwidth()
    original = moe_launchers.fused_moe
    res = {"bandwidth": bandwidth, "cfg": cfg}
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_model_folder(tokenizer, os.path.join(tmp, "qwen3-30b-a3b"))
        for name in ("base", "fused"):
            moe_launchers.fused_moe = original
            if name.startswith("fused"):
                patch(cfg)
            llm = make_moe_llm(folder, max_num_seqs=8, kv_cache_memory_bytes=8 << 30, max_model_len=4096)
            _, read = step_bytes(llm)
            rate = decode_rate(llm)
            b4 = batched_decode_rate(llm, 4)
            from engine import SamplingParams
            toks = llm.generate([list(range(1000, 1064))], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
            llm.shutdown()
            del llm
            release()
            res[name] = {"tok_s": rate, "ratio": rate * read / bandwidth, "b4": b4, "tokens": list(toks)}
            print(f"{name}: {rate:.1f} tok/s = {rate * read / bandwidth:.3f} of roofline; 4 seqs {b4:.1f}", flush=True)
    print("greedy equal:", res["base"]["tokens"] == res["fused"]["tokens"], flush=True)
    return res


def dense() -> dict:
    """Llama-3-8B's MLP at one row: the plugin's gated GEMV then down GEMV, against the fused kernel."""
    from engine_plugin_nvidia.gemm import CudaGemmBackend

    gemm = CudaGemmBackend("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    h, i = 4096, 14336
    gu = torch.randn(2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    dn_t = dn.t().contiguous().t()
    x = torch.randn(1, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    base = lambda: gemm.linear(gemm.gated_linear(x, gu, "silu"), dn)  # noqa: E731
    want = base().float()
    row = {"base": 1e6 * timed(base)}
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    topw = torch.ones(1, dtype=torch.float32, device="cuda")
    acc = torch.zeros(1, h, device="cuda", dtype=torch.float32)
    cnt = torch.zeros(1, device="cuda", dtype=torch.int32)
    out = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
    for layout, d in (("hi", dn), ("ih", dn_t)):
        for bi in (8, 16, 32, 64):
            for bk in (4096 // bi, 2048 // bi):
                for bh in (4096 // bi, 2048 // bi):
                    for warps in (4, 8):
                        name = f"{layout}_i{bi}_k{bk}_h{bh}_w{warps}"
                        if name not in KEEP_DENSE:
                            continue
                        args = (x, gu[None], d[None], ids, topw, acc, cnt, out, bi, bk, bh, warps)
                        try:
                            got = fused(*args, early=True).float()
                            err = float(((got - want).abs().max() / want.abs().max()).item())
                            us = 1e6 * timed(lambda a=args: fused(*a, early=True))
                        except Exception as exc:  # noqa: BLE001 - probe
                            row[name] = str(exc)[:80]
                            continue
                        row[name] = (us, err)
    ranked = sorted((v[0], k, v[1]) for k, v in row.items() if isinstance(v, tuple))
    print(f"dense MLP base {row['base']:.1f} us; best: " + "; ".join(f"{k} {us:.1f} (err {e:.1e})" for us, k, e in ranked[:6]), flush=True)
    return row


def main() -> None:
    results = {"dense": dense(), "sweep": sweep()}
    one = results["sweep"][1]
    hi = sorted((v[0], k) for k, v in one.items() if isinstance(v, tuple) and k.startswith("hi"))
    name = hi[0][1]
    parts = name.split("_")
    cfg = ("hi", int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:]), int(parts[4][1:]), name.endswith("_pre"))
    print("decode with", cfg, flush=True)
    if len(sys.argv) > 1:
        results["decode"] = decode(sys.argv[1], cfg)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "probe_moe_fused.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
