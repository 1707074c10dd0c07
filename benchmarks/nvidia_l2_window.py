"""Can a latency-bound kernel fill the L2 cache with the next product's weight while it runs? (NVIDIA, sm_80+)

At batch 1 a decode layer alternates memory-bound GEMVs with latency-bound kernels (decode attention and its merge,
the router and the routing) during which the memory idles: on an H200 about 8 us a Qwen3-30B-A3B layer, when the
memory could move some 30 MB. This measures, without the engine, whether ``prefetch.global.L2`` issued by such a
kernel's programs makes the GEMV after it faster, segments replayed in one CUDA graph with PDL as the decode graphs
run them, every segment with its own weights (so no weight stays in L2 from one segment to the next):

- ``dense``: GEMV over ``W_a`` (q/k/v-sized) -> a latency-bound kernel (a chain of dependent L2 reads, about an
  attention's length) -> GEMV over ``W_o`` (o_proj-sized), the chain kernel asking L2 for ``W_o`` or not.
- ``ahead``: the chain kernel asking L2 for ``W_next`` (the next layer's q/k/v), then a GEMV streaming the experts'
  bytes, then the GEMV over ``W_next``: does the early line survive the stream (``evict_last``) or not.

Each row prints microseconds a segment (median of repeats) for: no prefetch, ``prefetch.global.L2``, and
``prefetch.global.L2::evict_last``.

    python benchmarks/nvidia_l2_window.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

from engine_plugin_sdk.gpu.triton_kernels.l2_prefetch import ask_l2_share, l2_share_args  # noqa: E402
from engine_plugin_sdk.gpu.triton_kernels.pdl import gdc_launch_dependents, gdc_wait  # noqa: E402

#: the engine's batch-1 GEMV tile (the NVIDIA plugin's GEMV_TILE)
TILE = {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 2, "prefetch": 2}
MODES = {"none": 0, "L2": 1, "L2::evict_last": 2}
#: the chain kernel's table, output and program count, set once by ``main``
SHARED: dict[str, Any] = {}


@triton.jit
def chain_kernel(buf_ptr, out_ptr, l2_ptr, l2_lines, STEPS: tl.constexpr, USE_PDL: tl.constexpr,
                 L2_LINES: tl.constexpr = 0, L2_ASM: tl.constexpr = False, EVICT_LAST: tl.constexpr = False):  # fmt: skip
    """A latency-bound program (``STEPS`` dependent reads past L1), its share of ``l2_lines`` lines from ``l2_ptr``
    asked of the L2 cache first (:func:`.l2_prefetch.ask_l2_share`, as the engine's kernels ask)."""
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if L2_LINES > 0:
        ask_l2_share(l2_ptr, l2_lines, L2_LINES, L2_ASM, EVICT_LAST)
    i = pid % 64
    for _ in range(STEPS):
        i = tl.load(buf_ptr + i, cache_modifier=".cg")
    tl.store(out_ptr + pid, i)


def chain(buf: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, programs: int, steps: int, mode: int) -> None:
    """The chain kernel, asking for ``weight`` (``mode`` as :data:`MODES`) or not."""
    from engine_plugin_sdk.gpu.triton_kernels import pdl

    ask = l2_share_args(weight, programs, True) if mode else {"l2_ptr": buf, "l2_lines": 0}
    chain_kernel[(programs,)](
        buf, out, STEPS=steps, EVICT_LAST=mode == 2, num_warps=4, **ask, **pdl.launch_options(),
    )  # fmt: skip


def timed_us(fn: Any) -> float:
    """Median microseconds of ``fn()`` replayed in a CUDA graph recorded with PDL (``nvidia_h200_moe.timed``)."""
    from nvidia_h200_moe import timed

    return timed(fn, repeats=15, inner=1) * 1e6


def dense_segments(x_a: torch.Tensor, w_a: list[torch.Tensor], x_o: torch.Tensor, w_o: list[torch.Tensor],
                   steps: int, mode: int) -> None:  # fmt: skip
    """GEMV over ``w_a[s]``, the chain (asking for ``w_o[s]``), GEMV over ``w_o[s]``, for every segment ``s``."""
    from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

    for s in range(len(w_a)):
        gemv(x_a, w_a[s], **TILE)
        chain(SHARED["buf"], SHARED["out"], w_o[s], SHARED["programs"], steps, mode)
        gemv(x_o, w_o[s], **TILE)


def ahead_segments(x: torch.Tensor, w_next: list[torch.Tensor], w_stream: list[torch.Tensor], mode: int) -> None:
    """The chain asking for ``w_next[s]``, a GEMV streaming ``w_stream[s]``, then the GEMV over ``w_next[s]``."""
    from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

    for s in range(len(w_next)):
        chain(SHARED["buf"], SHARED["out"], w_next[s], SHARED["programs"], 16, mode)
        gemv(x, w_stream[s], **TILE)
        gemv(x, w_next[s], **TILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--segments", type=int, default=12, help="segments a graph, each with its own weights")
    parser.add_argument("--programs", type=int, default=128, help="the chain kernel's programs")
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 16, 40], help="its dependent reads")
    parser.add_argument("--stream-mb", type=int, nargs="+", default=[25, 75], help="bytes between, for 'ahead'")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    buf = ((torch.arange(64, device=dev, dtype=torch.int32) * 7 + 1) % 64).contiguous()
    out = torch.empty(args.programs, dtype=torch.int32, device=dev)
    SHARED.update(buf=buf, out=out, programs=args.programs)
    results: dict[str, float] = {}

    def make(n: int, k: int) -> list[torch.Tensor]:
        return [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(args.segments)]

    for name, (qkv_shape, o_shape) in {"qwen3-30b-a3b": ((5120, 2048), (2048, 4096)),
                                       "llama-3-8b": ((6144, 4096), (4096, 4096))}.items():  # fmt: skip
        w_a, w_o = make(*qkv_shape), make(*o_shape)
        x_a = torch.randn(qkv_shape[1], device=dev, dtype=dt)
        x_o = torch.randn(o_shape[1], device=dev, dtype=dt)
        for steps in args.steps:
            for label, mode in MODES.items():
                t = timed_us(functools.partial(dense_segments, x_a, w_a, x_o, w_o, steps, mode)) / args.segments
                results[f"dense {name} chain{steps} {label}"] = t
                print(f"dense {name:14s} chain {steps:3d} reads, prefetch {label:15s} {t:7.2f} us a segment", flush=True)
        w_a.clear()
        w_o.clear()
        torch.cuda.empty_cache()
    # the next layer's q/k/v asked for before the experts' bytes stream through
    w_next = make(5120, 2048)
    x = torch.randn(2048, device=dev, dtype=dt)
    for mb in args.stream_mb:
        w_stream = make(mb * (1 << 20) // (2 * 2048), 2048)
        for label, mode in MODES.items():
            t = timed_us(functools.partial(ahead_segments, x, w_next, w_stream, mode)) / args.segments
            results[f"ahead stream{mb}MB {label}"] = t
            print(f"ahead: {mb:3d} MB streamed between, prefetch {label:15s} {t:7.2f} us a segment", flush=True)
        w_stream.clear()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
