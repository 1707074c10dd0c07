"""Quantized weights read packed on the H200 (issue #25): GPTQ-style W4A16 and GGUF Q4_K / Q6_K through the
shared Triton grouped-integer kernels (a GEMV at batch 1, a GEMM above), against bf16.

Subcommands (repository root, on the device machine after ``source benchmarks/nvidia_h200_setup.sh``):

- ``check``: a tiny GPTQ W4A16 checkpoint and a tiny GGUF (Q4_K, lm_head Q6_K) on ``cuda``: greedy tokens
  and prefill logits of the packed weights against the same checkpoint dequantized at load
  (``quantization="none"``), in float32 (must agree) and bf16 (reported). ``--device cpu`` runs the same
  logic on the CPU, the NVIDIA platform in Triton's interpreter, float32 only (a smoke test).
- ``kernels``: each scheme's packed GEMV at the Llama-3-8B projection shapes (error against float64, time
  and bandwidth of the packed bytes per ``--gemv`` tile) against bf16, and the GEMM at a few row counts.
- ``bench``: Llama-3-8B shapes with random weights drawn on the GPU (no checkpoint written): batch-1 decode
  with CUDA graphs for bf16, W4A16 (``int4_grouped``, groups of 128, GPTQ's symmetric zero point), GGUF
  Q4_K_M (Q4_K, and Q6_K where llama.cpp's Q4_K_M puts it: ``attn_v`` / ``ffn_down`` of its "more bits"
  layers and ``output``) and that GGUF dequantized to bf16 at load; then ``--num-prompts`` x (512 in /
  256 out) offline throughput for bf16, W4A16 and an FP8 checkpoint (per-channel ``fp8_e4m3``).
  ``--decode-batch 2 4 8`` adds the total decode rate of that many sequences together, ``--fragment-ab`` each
  decode variant with the fragment kernel off, ``--grouped-tiles A=1,B=2`` again with those ``GroupedIntTiles`` fields.

    python benchmarks/nvidia_h200_quantized.py check --tokenizer .nvcarry/llama3-8b-dummy
    python benchmarks/nvidia_h200_quantized.py kernels
    python benchmarks/nvidia_h200_quantized.py bench --tokenizer .nvcarry/llama3-8b-dummy --json quantized.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "core" / "tests"), str(ROOT / "benchmarks")]

#: (out, in) of Llama-3-8B's products
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
#: what each weight kind is drawn as; "bf16" stays the dummy loader's own tensor
KINDS = ("int4_g128", "gguf_q4_0", "gguf_q8_0", "gguf_q3_k", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k", "gguf_iq4_xs")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_weight(kind: str, out: int, width: int, device: Any, gen: Any) -> Any:
    """A random quantized weight of ``kind`` made on ``device`` (values of order 0.02, as the dummy loader's).

    Args:
        kind: ``int4_g128`` (symmetric, fp16 scales), ``int4_g128_zp`` (a zero point per group, as AWQ's), a ``gguf_*`` scheme of :data:`KINDS`, ``fp8`` (an
            FP8 checkpoint's per-channel ``fp8_e4m3`` whose config quantizes activations too, W8A8) or
            ``fp8_weight_only`` (one that does not).
        out: rows.
        width: columns.
        device: where to draw it.
        gen: a torch generator on ``device``.

    Returns:
        The :class:`~engine.interfaces.gemm.QuantizedWeight`.
    """
    import gguf
    import torch

    from engine.interfaces.gemm import ACTIVATIONS_KEY, PER_TOKEN_ACTIVATIONS, QuantizedWeight
    from engine.interfaces.grouped_int import grouped_int_weight
    from engine_plugin_sdk.grouped_codes import dequantize_codes, grouped_codes

    def uniform(n: int, low: float, high: float) -> torch.Tensor:
        return torch.rand(n, generator=gen, device=device) * (high - low) + low

    if kind in ("int4_g128", "int4_g128_zp"):
        codes = torch.randint(0, 16, (out, width), generator=gen, device=device, dtype=torch.uint8)
        scales = uniform(out * width // 128, 0.003, 0.006).half().float().reshape(out, -1)
        if kind == "int4_g128":
            return grouped_int_weight(codes, scales, torch.full_like(scales, 8.0), 128, 4)
        zeros = torch.randint(0, 16, scales.shape, generator=gen, device=device).float()  # AWQ-style, per group
        return grouped_int_weight(codes, scales, zeros, 128, 4)
    if kind in ("fp8", "fp8_weight_only"):  # e4m3 has no infinity: values past 448 would become NaN, so clamp first
        scale = uniform(out, 0.02, 0.03) / 64
        data = (torch.randn(out, width, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        extra: dict[str, Any] = {"scale": scale}
        if kind == "fp8":
            # what the loader marks for a checkpoint whose config quantizes activations too (FP8_DYNAMIC,
            # activation_scheme "dynamic": the usual published FP8 checkpoint)
            extra[ACTIVATIONS_KEY] = PER_TOKEN_ACTIVATIONS
        return QuantizedWeight("fp8_e4m3", data, (out, width), lambda: data.float() * scale[:, None], extra)
    qtype = gguf.GGMLQuantizationType[kind[5:].upper()]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    count = out * width // values
    blocks = torch.randint(0, 256, (count, nbytes), generator=gen, device=device, dtype=torch.uint8)

    def put(at: int, low: float, high: float) -> None:
        blocks[:, at : at + 2] = uniform(count, low, high).half().view(torch.uint8).reshape(count, 2)

    if kind == "gguf_q6_k":
        blocks[:, 192:208] = torch.randint(-64, 64, (count, 16), generator=gen, device=device, dtype=torch.int8).view(torch.uint8)
        put(208, 2e-5, 6e-5)
    elif kind == "gguf_q3_k":  # 6-bit scales (sc - 32) and codes q - 4 average about 16 and 2.5
        put(108, 3e-4, 8e-4)
    elif kind in ("gguf_iq4_nl", "gguf_iq4_xs"):  # table values average about 60 (IQ4_XS: times ls - 32, ~16)
        put(0, *((2e-4, 5e-4) if kind == "gguf_iq4_nl" else (1.2e-5, 3e-5)))
    else:  # Q4_K / Q5_K: d and dmin first; Q4_0 / Q8_0: one fp16 scale first
        ranges = {"gguf_q4_k": (5e-5, 1.5e-4), "gguf_q5_k": (2.5e-5, 7.5e-5), "gguf_q4_0": (2e-3, 6e-3),
                  "gguf_q8_0": (1e-4, 3e-4)}  # fmt: skip
        for at in (0, 2) if kind in ("gguf_q4_k", "gguf_q5_k") else (0,):
            put(at, *ranges[kind])
    weight = QuantizedWeight(kind, blocks.reshape(out, -1), (out, width), None, {"ggml_type": int(qtype)})
    weight.dequantize = lambda: dequantize_codes(grouped_codes(weight, device))
    return weight


def q4_k_m_kind(name: str, layers: int, base: str = "gguf_q4_k") -> str:
    """llama.cpp's Q4_K_M choice for a tensor: Q6_K for ``output``, and for ``attn_v`` / ``ffn_down`` of the
    first and last eighth of the layers and every third between (``use_more_bits``), Q4_K elsewhere (``base``:
    Q5_K for Q5_K_M, which makes the same choice)."""
    if name == "lm_head.weight":
        return "gguf_q6_k"
    if name.endswith(("v_proj.weight", "down_proj.weight")):
        i = int(name.split(".")[2])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "gguf_q6_k"
    return base


def q3_k_m_kind(name: str, layers: int) -> str:
    """llama.cpp's Q3_K_M choice for a tensor: Q6_K for ``output``; Q4_K for ``attn_output`` and ``attn_v`` (Q5_K in
    the first two layers); for ``ffn_down`` Q5_K in the first sixteenth of the layers, Q4_K where
    ``use_more_bits`` (as in :func:`q4_k_m_kind`), Q3_K elsewhere and for the other matrices."""
    if name == "lm_head.weight":
        return "gguf_q6_k"
    if name.endswith(("v_proj.weight", "o_proj.weight", "down_proj.weight")):
        i = int(name.split(".")[2])
        if name.endswith("o_proj.weight"):
            return "gguf_q4_k"
        if name.endswith("v_proj.weight"):
            return "gguf_q5_k" if i < 2 else "gguf_q4_k"
        if i < layers // 16:
            return "gguf_q5_k"
        return "gguf_q4_k" if q4_k_m_kind(name, layers) == "gguf_q6_k" else "gguf_q3_k"
    return "gguf_q3_k"


#: variant -> how the dummy loader's tensors become weights: (name, layers) -> kind, or None to keep bf16;
#: ``:dense`` dequantizes the drawn weight at load (the GGUF path before packed GGUF on GPUs)
PLANS: dict[str, Callable[[str, int], str | None]] = {
    "bf16": lambda name, layers: None,
    "w4a16": lambda name, layers: "int4_g128" if name.split(".")[-2] in PROJECTIONS else None,
    "w4a16_zp": lambda name, layers: "int4_g128_zp" if name.split(".")[-2] in PROJECTIONS else None,
    "gguf_q4_k_m": lambda name, layers: q4_k_m_kind(name, layers) if name != "model.embed_tokens.weight" else None,
    "gguf_q4_k_m_dequantized": lambda name, layers: (
        q4_k_m_kind(name, layers) + ":dense" if name != "model.embed_tokens.weight" else None
    ),
    "gguf_q5_k_m": lambda name, layers: (
        q4_k_m_kind(name, layers, "gguf_q5_k") if name != "model.embed_tokens.weight" else None
    ),
    "gguf_q5_k_m_dequantized": lambda name, layers: (
        q4_k_m_kind(name, layers, "gguf_q5_k") + ":dense" if name != "model.embed_tokens.weight" else None
    ),
    "gguf_q3_k_m": lambda name, layers: q3_k_m_kind(name, layers) if name != "model.embed_tokens.weight" else None,
    "gguf_q3_k_m_dequantized": lambda name, layers: (
        q3_k_m_kind(name, layers) + ":dense" if name != "model.embed_tokens.weight" else None
    ),
    "gguf_iq4_xs": lambda name, layers: (
        ("gguf_q6_k" if name == "lm_head.weight" else "gguf_iq4_xs") if name != "model.embed_tokens.weight" else None
    ),
    "gguf_iq4_xs_dequantized": lambda name, layers: (
        ("gguf_q6_k" if name == "lm_head.weight" else "gguf_iq4_xs") + ":dense"
        if name != "model.embed_tokens.weight" else None
    ),
    "fp8": lambda name, layers: "fp8" if name.split(".")[-2] in PROJECTIONS else None,
    "fp8_weight_only": lambda name, layers: "fp8_weight_only" if name.split(".")[-2] in PROJECTIONS else None,
}

#: the decode variants whose products run the grouped-integer kernels (the others ignore their tiles)
GROUPED_DECODE = ("w4a16", "w4a16_zp", "gguf_q4_k_m", "gguf_q5_k_m", "gguf_q3_k_m", "gguf_iq4_xs")


@contextlib.contextmanager
def dummy_as(plan: Callable[[str, int], str | None]) -> Iterator[None]:
    """Within the block, ``load_format="dummy"`` yields the weights ``plan`` names, drawn on the device,
    instead of its bf16 matrices (the engine then prepares them as it would a checkpoint's)."""
    import torch

    from engine import engine_setup

    original = engine_setup.dummy_weights

    def patched(config: Any, seed: int = 0, dtype: Any = None, device: Any = "cpu", registry: Any = None) -> Iterator:
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        for name, tensor in original(config, seed=seed, dtype=dtype, device=device, registry=registry):
            kind = plan(name, config.num_layers) if tensor.dim() == 2 else None
            if kind is None:
                yield name, tensor
                continue
            shape = tuple(tensor.shape)
            del tensor  # only its shape is used: keep one matrix at a time
            weight = random_weight(kind.split(":")[0], *shape, device, gen)
            yield name, weight.dequantize().to(dtype) if kind.endswith(":dense") else weight

    engine_setup.dummy_weights = patched
    try:
        yield
    finally:
        engine_setup.dummy_weights = original


def step_bytes(llm: Any) -> int:
    """Bytes a batch-1 decode step reads: every layer tensor in its stored form, the final norm, the LM head."""
    import torch

    from engine.models.layers.row_blocks import RowBlocks
    from engine_plugin_sdk.gpu.gemm import Fp8Weight, GroupedIntRowBlocks, GroupedIntWeight

    def size(t: Any) -> int:
        if isinstance(t, RowBlocks):
            return sum(size(part) for part in t.parts)
        if isinstance(t, GroupedIntWeight | GroupedIntRowBlocks):
            return t.nbytes
        if isinstance(t, Fp8Weight):
            return size(t.data) + size(t.scale)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    model = llm.llm_engine.model
    layers = sum(size(getattr(layer, f.name)) for layer in model.layers for f in dataclasses.fields(layer))
    return layers + size(model.lm_head) + size(model.final_norm)


def llama3_folder(tokenizer: str, out: str) -> str:
    """A config-only Llama-3-8B folder with ``tokenizer``'s files."""
    from make_dummy_llama3_8b import LLAMA3_8B
    from nvidia_h200_dense import tokenizer_only

    folder = tokenizer_only(tokenizer, out)
    Path(folder, "config.json").write_text(json.dumps(LLAMA3_8B), encoding="utf-8")
    return folder


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from nvidia_h200 import batched_decode_rate, copy_bandwidth, decode_rate, release

    from engine import LLM, SamplingParams
    from engine_plugin_sdk.gpu.triton_kernels.variants import watch_compiles

    bandwidth = copy_bandwidth()
    results: dict[str, Any] = {"copy_bandwidth_TBps": bandwidth / 1e12}
    with tempfile.TemporaryDirectory() as tmp:
        folder = llama3_folder(args.tokenizer, os.path.join(tmp, "llama3-8b"))
        tile_settings = [("", {})] + ([("_no_fragment", {"fragment_rows": 0})] if args.fragment_ab else [])
        tile_settings += [(f"_{spec}", tile_overrides(spec)) for spec in args.grouped_tiles]
        for variant in args.decode:
            for suffix, overrides in tile_settings:
                if suffix and variant not in GROUPED_DECODE:
                    continue  # no grouped-integer product to change
                label = f"{variant}{suffix}"
                t0 = time.perf_counter()
                with dummy_as(PLANS[variant]), grouped_tiles(overrides):
                    llm = LLM(model=folder, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=8,
                              kv_cache_memory_bytes=8 << 30, max_model_len=4096)  # fmt: skip
                start = time.perf_counter() - t0
                read, rate = step_bytes(llm), decode_rate(llm, new_tokens=args.decode_tokens)
                roofline = bandwidth / read
                results[f"decode_{label}"] = {"GB_read_per_step": read / 1e9, "decode_tok_s": rate,
                                              "roofline_tok_s": roofline, "ratio_to_roofline": rate / roofline,
                                              "engine_start_s": start}  # fmt: skip
                print(f"decode {label:24s} {read / 1e9:6.2f} GB/step  {rate:7.1f} tok/s  roofline {roofline:7.1f}"
                      f" ({rate / roofline:.2f})  start {start:.0f} s", flush=True)  # fmt: skip
                if args.profile:
                    from nvidia_h200_profile_decode import kernel_table

                    results[f"decode_{label}"]["kernels"] = kernel_table(llm, 16, graphs=True, top=args.profile)
                if args.profile_products is not None:
                    from nvidia_h200_profile_decode import layer_products

                    for requests in args.profile_products or [1]:
                        key = "products" if requests == 1 else f"products_{requests}"
                        results[f"decode_{label}"][key] = layer_products(llm, 16, requests)
                for batch in args.decode_batch:
                    total = batched_decode_rate(llm, batch, new_tokens=args.decode_tokens)
                    results[f"decode_{label}"][f"batch_{batch}_tok_s"] = total
                    print(f"decode {label:24s} {batch} sequences: {total:7.1f} tok/s in all", flush=True)
                del llm
                release()
        rng = random.Random(0)
        prompts = [[rng.randint(1000, 40000) for _ in range(512)] for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        for variant in args.throughput:
            with dummy_as(PLANS[variant]):
                llm = LLM(model=folder, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=1024,
                          max_num_batched_tokens=16384, memory_fraction=0.9, max_model_len=1024)  # fmt: skip
            llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
            with watch_compiles() as compiled:
                t0 = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
            produced = sum(len(o.outputs[0].token_ids) for o in outputs)
            # Triton kernels compiled inside the timed run (each a stall of a second or more); should be none
            results[f"throughput_{variant}"] = {"seconds": seconds, "output_tok_s": produced / seconds,
                                                "num_prompts": args.num_prompts,
                                                "kernel_variants_compiled_during_run": compiled}  # fmt: skip
            print(f"throughput {variant:8s} {args.num_prompts} x (512 in / 256 out): {seconds:6.1f} s, "
                  f"{produced / seconds:8.0f} output tok/s; compiled during the run: "
                  f"{({k: len(v) for k, v in compiled.items()}) or 'none'}", flush=True)  # fmt: skip
            del llm, outputs
            release()
    return results


def tile_overrides(spec: str) -> dict[str, int]:
    """``GroupedIntTiles`` fields from ``"fragment_depth=2,fragment_min_rows=1"``."""
    return {key.strip(): int(value) for key, _, value in (item.partition("=") for item in spec.split(","))}


@contextlib.contextmanager
def grouped_tiles(overrides: dict[str, int]) -> Iterator[None]:
    """Within the block, engines start with the NVIDIA grouped-integer tiles' fields replaced by ``overrides``
    (on a fast-memory GPU the plugin's own choices on top, but for those an override names). The backend reads
    the tiles when its first grouped-integer product runs: at start-up, before the graphs."""
    import engine_plugin_nvidia.gemm as nvidia_gemm
    from engine_plugin_sdk.gpu.triton_kernels import grouped_int_tiles

    saved, saved_fast = grouped_int_tiles.H200_GROUPED_INT_TILES, nvidia_gemm.FAST_MEMORY_DOT_GEMV
    nvidia_gemm.FAST_MEMORY_DOT_GEMV = {k: v for k, v in saved_fast.items() if k not in overrides}
    overrides = dict(overrides)
    if "gemm_first" in overrides:  # the GEMM's first entry (2-16 rows), its five numbers run together: 16163243
        f = str(overrides.pop("gemm_first"))
        overrides["gemm"] = ((int(f[:2]), int(f[2:4]), int(f[4:6]), int(f[6]), int(f[7])), *saved.gemm[1:])
    grouped_int_tiles.H200_GROUPED_INT_TILES = dataclasses.replace(saved, **overrides)
    try:
        yield
    finally:
        grouped_int_tiles.H200_GROUPED_INT_TILES, nvidia_gemm.FAST_MEMORY_DOT_GEMV = saved, saved_fast


def timed_rotating(fn: Callable[[Any], Any], inputs: list[Any], repeats: int = 10) -> float:
    """Median seconds of one ``fn(input)``, the inputs (distinct weight copies, together larger than the
    L2 cache) taken in turn inside one CUDA graph, as a decode step's products are."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for item in inputs:
            fn(item)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in inputs:
            fn(item)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(inputs))
    return sorted(times)[len(times) // 2]


def cmd_kernels(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from nvidia_h200 import release

    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_sdk.gpu.triton_kernels import pdl
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import GroupedIntTiles, dequantize_grouped
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import dequantize_packed

    pdl.configure(torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gemm = CudaGemmBackend("cuda")
    results: dict[str, Any] = {}
    for shape, (n, k) in SHAPES.items():
        copies = max(1, min(16, (256 << 20) // (n * k // 2)))
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        dense = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        with pdl.for_capture():
            sec = timed_rotating(lambda w, x=x: gemm.linear(x, w), dense)
        row: dict[str, Any] = {"bf16": {"us": sec * 1e6, "TBps": n * k * 2 / sec / 1e12}}
        del dense
        for kind in args.kinds:
            weights = [gemm.prepare_weight(random_weight(kind, n, k, "cuda", gen), torch.bfloat16) for _ in range(copies)]
            ref = x.double() @ dequantize_packed(weights[0]).double().T
            for tile, loop_stages in ((t, s) for t in args.gemv for s in args.gemv_loop_stages):
                gemm.grouped_int_tiles = GroupedIntTiles(gemv=tile, gemv4=tile, gemv_loop_stages=loop_stages)
                got = gemm.linear(x, weights[0]).double()
                err = float((got - ref).norm() / ref.norm())
                with pdl.for_capture():
                    sec = timed_rotating(lambda w, x=x: gemm.linear(x, w), weights)
                label = f"{kind} gemv{tile}" + (f" loop stages {loop_stages}" if loop_stages > 1 else "")
                row[label] = {"us": sec * 1e6, "TBps": weights[0].nbytes / sec / 1e12, "rel_err": err}
            gemm.grouped_int_tiles = None
            # the default tiles, each --gemm-tiles entry, then the dense copy and the vendor GEMM
            variants = {"": None, **{f" {t}": GroupedIntTiles(gemm=((0, *t),)) for t in args.gemm_tiles},
                        " dense": GroupedIntTiles(dense_rows=1)}  # fmt: skip
            for rows in args.gemm_rows:
                xs = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                ref_m = xs.double() @ dequantize_packed(weights[0]).double().T
                for label, tiles in variants.items():
                    gemm.grouped_int_tiles = tiles
                    err = float((gemm.linear(xs, weights[0]).double() - ref_m).norm() / ref_m.norm())
                    sec = timed_rotating(lambda w, xs=xs: gemm.linear(xs, w), weights)
                    row[f"{kind} gemm M={rows}{label}"] = {
                        "us": sec * 1e6, "TFLOPs": 2 * rows * n * k / sec / 1e12, "rel_err": err,
                    }  # fmt: skip
                gemm.grouped_int_tiles = None
            sec = timed_rotating(lambda w: dequantize_grouped(w, torch.bfloat16), weights)
            row[f"{kind} dequantize"] = {"us": sec * 1e6, "TBps": weights[0].nbytes / sec / 1e12}
            del weights
        for rows in args.gemm_rows:
            xs = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            sec = timed_rotating(lambda w, xs=xs: torch.nn.functional.linear(xs, w), [w])
            row[f"bf16 gemm M={rows}"] = {"us": sec * 1e6, "TFLOPs": 2 * rows * n * k / sec / 1e12}
        results[shape] = row
        for name, v in row.items():
            extra = f"{v['TBps']:.2f} TB/s" if "TBps" in v else f"{v['TFLOPs']:.0f} TFLOP/s"
            err = f"  rel err {v['rel_err']:.1e}" if "rel_err" in v else ""
            print(f"{shape:8s} {name:34s} {v['us']:9.1f} us  {extra}{err}", flush=True)
        release()
    return results


def tile(text: str) -> tuple[int, ...]:
    """``"4,512,4,3"`` -> ``(4, 512, 4, 3)``."""
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    default_tok = str(ROOT / ".nvcarry" / "llama3-8b-dummy")
    check = sub.add_parser("check", help="packed vs dequantized greedy tokens of tiny GPTQ / GGUF checkpoints")
    check.add_argument("--one-at-a-time", action="store_true",
                       help="generate each prompt alone (batch-1 decode: the GEMVs) instead of all together")
    check.add_argument("--grouped-tiles", default="",
                       help="GroupedIntTiles fields of the H200 to check with, e.g. six_bit_codes=1")
    check.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                       help="cpu: the NVIDIA platform in Triton's interpreter (float32 only; slow, a smoke test)")
    kernels = sub.add_parser("kernels", help="the packed GEMV / GEMM per Llama-3-8B shape against bf16")
    kernels.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    kernels.add_argument("--gemv", type=tile, nargs="+", default=[(4, 1024, 4, 2), (4, 2048, 4, 2)],
                         help="GEMV tiles as rows,row_bytes,num_warps,num_stages (GroupedIntTiles.gemv and "
                         "gemv4)")
    kernels.add_argument("--gemv-loop-stages", type=int, nargs="+", default=[1],
                         help="GroupedIntTiles.gemv_loop_stages of each GEMV tile (3: pipelined past the first tile)")
    kernels.add_argument("--gemm-rows", type=int, nargs="*", default=[16, 256])
    kernels.add_argument("--gemm-tiles", type=tile, nargs="*", default=[],
                         help="block_m,block_n,warps,stages of the grouped GEMM to time besides the defaults")
    bench = sub.add_parser("bench", help="Llama-3-8B decode and throughput, bf16 against the quantized forms")
    bench.add_argument("--decode", nargs="*", default=["bf16", "w4a16", "gguf_q4_k_m", "gguf_q4_k_m_dequantized"],
                       choices=list(PLANS))
    bench.add_argument("--decode-tokens", type=int, default=256)
    bench.add_argument("--decode-batch", type=int, nargs="*", default=[],
                       help="also decode this many sequences together (up to 8) and report the total rate")
    bench.add_argument("--fragment-ab", action="store_true",
                       help="each decode variant also with the fragment kernel off (2-8 rows on the older kernels)")
    bench.add_argument("--grouped-tiles", nargs="*", default=[],
                       help="each decode variant also with these GroupedIntTiles fields of the H200, e.g. "
                       "fragment_depth=2,fragment_min_rows=1 (1 row takes the fragment kernel too) or "
                       "gemv_loop_stages=3")
    bench.add_argument("--throughput", nargs="*", default=["bf16", "w4a16", "fp8"], choices=list(PLANS))
    bench.add_argument("--num-prompts", type=int, default=1000)
    bench.add_argument("--profile", type=int, default=0, metavar="TOP",
                       help="also list the TOP kernels of the decode graphs by time (torch.profiler, 16 steps)")
    bench.add_argument("--profile-products", type=int, nargs="*", default=None, metavar="SEQUENCES",
                       help="also time each product of a decode step (of 1 or these many sequences) by its place in "
                       "the layer (run with "
                       "ENGINE_NVIDIA_PDL=0: under PDL a kernel's time includes its wait)")
    bench.add_argument("--without-norms", action="store_true",
                       help="the residual norms return their input (wrong tokens on purpose): what the norm nodes cost")
    for p in (check, bench):
        p.add_argument("--tokenizer", default=default_tok, help="a folder holding a HF tokenizer")
    for p in sub.choices.values():
        p.add_argument("--json", default=None)
    args = parser.parse_args()
    from nvidia_h200_quantized_check import cmd_check

    if getattr(args, "without_norms", False):
        from nvidia_h200_decode_nodes import without_norms

        without_norms()
    result = {"check": cmd_check, "kernels": cmd_kernels, "bench": cmd_bench}[args.command](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.command == "check" and not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
