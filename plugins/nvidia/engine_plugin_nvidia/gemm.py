"""GEMM on NVIDIA GPUs: bf16 / fp16 / fp32 through torch (cuBLAS), FP8 e4m3 weights through torch's scaled matmul,
and single-row bf16 / fp16 products (batch-1 decode) through a Triton GEMV, which streams the weight faster.

The implementation, including the two-term FP8 activations, is :mod:`engine_plugin_sdk.gpu.gemm`
(shared with the ROCm plugin). NVIDIA's FP8 tensor cores (Ada / Hopper and later) multiply the OCP
``float8_e4m3fn`` that checkpoints store, so weights load without conversion.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine_plugin_sdk import RowQuantizedActivations
from engine_plugin_sdk.gpu import fp8_gemm as _common
from engine_plugin_sdk.gpu.fp8_gemm import FP8_SCHEME, Fp8Weight, fp8_linear
from engine_plugin_sdk.gpu.gemm import TorchGemmBackend

# the helpers (fp8_linear, split_quantize_rows, ...) live in engine_plugin_sdk.gpu.fp8_gemm
__all__ = ["FP8_MAX", "FP8_SCHEME", "CudaGemmBackend", "Fp8Weight"]

#: the FP8 dtype NVIDIA's tensor cores take
FP8_DTYPE = "float8_e4m3fn"
#: largest finite e4m3fn value
FP8_MAX = _common.FP8_MAX[FP8_DTYPE]
#: the Triton GEMV's tile for single-row products whose weight has no more rows than columns (o_proj,
#: down_proj); measured on an H200 at Llama-3-8B shapes: 10.6 us vs cuBLAS 12.6 us + a split-K reduce
#: for 4096x4096, 30.6 vs 32.4 + reduce for 4096x14336 (benchmarks/nvidia_h200_profile.py gemv)
#: ``prefetch``: weight tiles each program loads before its PDL wait, while the kernels before it still run
#: (2 against 1: Gemma-2-9B batch-1 decode 187.7 -> 193.7 tok/s, Qwen3-8B 238.2 -> 247.7, H200 2026-12-03)
GEMV_TILE = {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 2, "prefetch": 2}
#: the tile for single-row products with more rows than columns (qkv, gate_up, lm_head), or None to leave
#: them to cuBLAS. Chosen on an H200 (2026-11-29, `nvidia_h200_profile.py variants`) as the config with the
#: least time per token over qkv x32 + gate_up x32 + lm_head: 2456 us vs cuBLAS 2535 (lm_head 238.6 us
#: = 4.40 TB/s, gate_up 55.1, qkv 14.2); batch-1 decode 239.2 tok/s vs 225.3 with cuBLAS there, since
#: in a graph the GEMV also starts early under PDL (cuBLAS's kernels cannot). Used only while a CUDA graph
#: is being captured: eagerly, the host launches the step, and a Triton launch costs it more than cuBLAS's
#: (eager batch-1 decode fell from 86 to 66 tok/s with it)
GEMV_WIDE_TILE: dict | None = GEMV_TILE
#: the tile of the batch-1 LM head (``logits``), or None for cuBLAS plus a float32 copy. The logits run
#: after the decode graph, eagerly, but they are one launch a step, not a layer's many: the host cost
#: is one Triton launch, hidden behind the step in flight, while cuBLAS streams this widest weight
#: slowest (3.3-3.9 TB/s against the GEMV's 4.4 at Llama-3-8B's lm_head; Gemma-2's tied head is 1.8 GB).
#: The GEMV also writes float32 straight from its accumulator: no bf16 rounding and no cast kernel
LOGITS_GEMV_TILE: dict | None = GEMV_TILE
#: the tile of the gated GEMV (gate/up and the activation in one kernel, batch 1): ``block_n`` gate rows
#: and as many up rows a program, so the same 4 x 1024 register tile as ``GEMV_TILE`` twice over
GATED_GEMV_TILE = {"block_n": 2, "block_k": 1024, "num_warps": 4, "num_stages": 2, "prefetch": 2}
_GEMV_DTYPES = (torch.bfloat16, torch.float16)
#: the 4-bit fragment kernel's warp-level ``mma.m16n8k16`` (bf16 and fp16) exists from Ampere on
FRAGMENT_MIN_CAPABILITY = (8, 0)
#: memory bandwidth a multiprocessor (bytes/s, from the memory's clock and bus width) from which the packed
#: products at one row are bound by each SM's instruction issue rather than by the memory: an H200 (4.8 TB/s over
#: 132 SMs, 37 GB/s each) is, an H100 (3.35 TB/s, 25 GB/s each) is not
FAST_MEMORY_BYTES_PER_SM = 30e9
#: the integer-dot GEMV's choices there: one activation row takes 16 rows a program (one row's conversion shared by
#: twice the rows) and comes converted by the norm's kernel (``dot_gemv_prepared``). On an H100 held to 96 SMs (35
#: GB/s each, ``benchmarks/nvidia_sm_partition.py``; 2026-12-07, one process): W4A16 batch-1 decode 440.2 -> 464.1
#: tok/s, GGUF Q4_K_M 377.4 -> 433.2 (bf16 186.2); on the whole H100 479.0 against 482.3 and 436.5 against 439.7.
#: GPTQ / AWQ's form (one zero point) reads its group parameters from the program-order copy too (2026-12-07, session
#: 56, W4A16 one process each: the stand-in 1 sequence 460.4 -> 474.3 tok/s, 2 sequences 712.5 -> 728.1; the whole
#: H100 485.5 -> 461.8 and 780.3 -> 777.0). Two activation rows take 16 rows a program on every GPU
#: (``GroupedIntTiles.dot_gemv_x_rows_rows``).
FAST_MEMORY_DOT_GEMV = {"dot_gemv_rows": 16, "dot_gemv_prepared": True, "dot_gemv_program_params_zero_point": True}
#: the MoE kernels' choices there: the batch-1 down GEMV takes 256 columns a step, not 1,024. Qwen3-30B-A3B's experts
#: are 768 wide, so a 1,024-column tile masks a quarter of its lanes and each program sums across its threads once an
#: expert; 256 columns take three unmasked steps (sm_90 code: 0.20 instructions a weight element against 0.30). On an
#: H100 held to 96 SMs (2026-12-07, session 57, separate processes): batch-1 decode 298.1 -> 320.9 / 321.0 tok/s (0.601
#: -> 0.647 of the roofline; 8 x 256 315.1, 4 x 256 at 2 warps 315.0, 2 x 256 308.7); on the whole H100, where the
#: memory and not the issue binds, 332.1 / 332.6 against 323.3. The tile also keeps the four early experts' tiles
#: (``down_prefetch``) a quarter of 4 x 1,024's registers: there 4 x 1,024 without them ran 325.2 against 323.8 / 323.9
#: at 4 x 256 with them, and 4 x 256 with 8 early experts 305.8, while the H200 measured 4 x 1,024's early tiles +2.5%
#: (2026-12-04); ``benchmarks/nvidia_h200_pending.sh moe-tiles`` is the H200's A/B of the three.
FAST_MEMORY_MOE = {"down_gemv": (4, 256, 4)}
#: ``0``: a mixture of experts' router leaves the residual norm before it to the norm kernel. By default its batch-1
#: GEMV takes the norm (one launch a layer fewer, :meth:`CudaGemmBackend.add_rms_norm_router`): on the H200 stand-in
#: (an H100 at 94 SMs, 2026-12-07) Qwen3-30B-A3B batch 1 ran 326.7 / 326.7 tok/s with it against 323.9 / 325.4
#: without, alternated in one process (``benchmarks/nvidia_h200_pending.sh router-norm``)
ROUTER_NORM_ENV = "ENGINE_NVIDIA_ROUTER_NORM"
#: ``0``: the attention's q/k/v leaves the residual norm before it to the norm kernel; ``1`` (or a tile
#: ``block_n,block_k,num_warps``): its batch-1 GEMV takes it whatever its size (every program summing the row itself,
#: :meth:`CudaGemmBackend.add_rms_norm_linear`). Unset, GPUs take it for weights of at most
#: :data:`LINEAR_NORM_MAX_BYTES`: on the H200 stand-in (2026-12-07, ``nvidia_h200_moe.py decode --env-ab``)
#: Qwen3-30B-A3B's q/k/v (2,048 -> 5,120, 20 MiB) gained 1.2% at batch 1 (330.2 / 331.7 against 326.6 / 327.5 tok/s,
#: alternated), Llama-3-8B's (4,096 -> 6,144, 48 MiB) lost 1.4% (186.5 / 186.5 against 189.1 / 189.1, 8 x 512 -1.1%,
#: 16 x 256 -1.6%): the saved launch is fixed, the programs' repeated sums grow with the weight
LINEAR_NORM_ENV = "ENGINE_NVIDIA_LINEAR_NORM"
LINEAR_NORM_MAX_BYTES = 32 << 20


class CudaGemmBackend(TorchGemmBackend):
    """``torch.nn.functional.linear`` on the GPU; FP8 e4m3 weights stay FP8 where the GPU has FP8 units.

    Args:
        device: where weights go.
        fp8: keep ``fp8_e4m3`` weights in FP8 (True on Ada / Hopper and later); otherwise they are
            dequantized at load like every other scheme.
        fp8_dtype: the shared backends' spelling of ``fp8=True`` (what the platform passes); only
            ``"float8_e4m3fn"`` runs on NVIDIA.

    Raises:
        ValueError: for an ``fp8_dtype`` other than ``"float8_e4m3fn"``.
    """

    def __init__(self, device: Any, fp8: bool = False, fp8_dtype: str | None = None) -> None:
        if fp8_dtype not in (None, FP8_DTYPE):
            raise ValueError(f"fp8_dtype must be {FP8_DTYPE!r} or None on NVIDIA, got {fp8_dtype!r}")
        super().__init__(device, fp8_dtype=FP8_DTYPE if fp8 or fp8_dtype else None)
        # the router's product with its norm (add_rms_norm_router), unless turned off for an A/B
        # (benchmarks/nvidia_h200_moe.py decode --env-ab ENGINE_NVIDIA_ROUTER_NORM=0 ...)
        self.triton_router_norm = self.device.type == "cuda" and os.environ.get(ROUTER_NORM_ENV, "1").strip() != "0"
        # q/k/v's product with its norm (add_rms_norm_linear): by size on GPUs, or asked for by name (in the
        # interpreter too, which runs the same kernel on the CPU)
        setting = os.environ.get(LINEAR_NORM_ENV)
        self.linear_norm_tile = None if setting is None else linear_norm_tile(setting)
        self.triton_linear_norm = self.linear_norm_tile is not None or (setting is None and self.device.type == "cuda")

    def _grouped_int_tiles(self) -> Any:
        # NVIDIA's tiles add the tensor-core kernels for a few rows (their inline PTX runs on no other vendor);
        # the fragment kernel's mma.m16n8k16 needs Ampere or later
        if self.grouped_int_tiles is None:
            import dataclasses

            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES

            tiles = H200_GROUPED_INT_TILES
            if torch.cuda.get_device_capability(self.device) < FRAGMENT_MIN_CAPABILITY:
                # and the integer-dot GEMV's NaN-keeping max (max.NaN.f32) is sm_80's too
                tiles = dataclasses.replace(tiles, fragment_rows=0, dot_gemv_rows=0)
            elif fast_memory(memory_bytes_per_sm(self.device)):
                tiles = dataclasses.replace(tiles, **FAST_MEMORY_DOT_GEMV)
            self.grouped_int_tiles = tiles
        return self.grouped_int_tiles

    def _moe_tiles(self) -> Any:
        if self.moe_tiles is None:
            import dataclasses

            from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import H200_MOE_TILES

            tiles = H200_MOE_TILES
            if fast_memory(memory_bytes_per_sm(self.device)):
                tiles = dataclasses.replace(tiles, **FAST_MEMORY_MOE)
            self.moe_tiles = tiles
        return self.moe_tiles

    def _router_norm_tile(self) -> dict[str, int]:
        # a router is a narrow product (experts x hidden): the narrow weights' GEMV tile
        return GEMV_TILE

    def _linear_norm_tile(self, weight: torch.Tensor) -> dict[str, int] | None:
        if self.linear_norm_tile is not None:
            return self.linear_norm_tile  # asked for by name: every size
        return GEMV_TILE if weight.numel() * weight.element_size() <= LINEAR_NORM_MAX_BYTES else None

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        if isinstance(x, RowQuantizedActivations):
            return super().linear(x, weight, bias)
        if isinstance(weight, Fp8Weight) and weight.per_token_activations and x.is_cuda:
            from engine_plugin_sdk.gpu.triton_kernels.launchers import quantize_rows_fp8

            # one fused pass over the activations instead of torch's five
            return fp8_linear(x, weight, bias, quantize=quantize_rows_fp8)
        tile = _gemv_tile(x, weight)
        if tile is not None:
            from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

            return gemv(x, weight, bias, **tile)
        return super().linear(x, weight, bias)

    def gated_linear(self, x: Any, weight: Any, activation: str) -> Any:
        # one row: the gated GEMV streams gate and up rows together and applies the activation to its
        # accumulators, one launch instead of cuBLAS's (or the GEMV's) plus the activation kernel's
        if activation in self.gated_activations and _gemv_fits(x, weight):
            from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gated_gemv

            return gated_gemv(x, weight, activation, **GATED_GEMV_TILE)
        return super().gated_linear(x, weight, activation)

    def logits(self, x: Any, weight: Any) -> Any:
        if LOGITS_GEMV_TILE is not None and _gemv_fits(x, weight):
            from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import gemv

            return gemv(x, weight, out_dtype=torch.float32, **LOGITS_GEMV_TILE)
        return super().logits(x, weight)


def fast_memory(bytes_per_sm: float | None) -> bool:
    """Whether a GPU streaming ``bytes_per_sm`` a second through each multiprocessor takes the fast-memory tiles
    (``None``: not known, no)."""
    return bytes_per_sm is not None and bytes_per_sm >= FAST_MEMORY_BYTES_PER_SM


def memory_bytes_per_sm(device: Any) -> float | None:
    """The GPU's peak memory bandwidth (double data rate: two transfers a memory clock over its bus) over the
    multiprocessors its kernels run on (the tuning's count, which a benchmark may hold below the GPU's); None where
    the device does not report its memory clock or bus width."""
    from engine_plugin_nvidia.tuning import tuning_for_device

    clock_khz, bus_bits = _memory_clock_and_bus(torch.device(device).index or 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / tuning_for_device(False).num_compute_units


def _memory_clock_and_bus(index: int) -> tuple[int, int]:
    """(peak memory clock in kHz, memory bus width in bits) of GPU ``index`` as torch's device properties report
    them (an H100 80GB HBM3 under torch 2.11 + CUDA 13: 2,619,000 and 5,120); (0, 0) where they do not."""
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "memory_clock_rate", 0) or 0), int(getattr(props, "memory_bus_width", 0) or 0)


def _gemv_tile(x: Any, weight: Any) -> dict | None:
    """The Triton GEMV's tile for a batch-1 product on a GPU in bf16/fp16, or None for cuBLAS
    (``GEMV_TILE`` for narrow weights, ``GEMV_WIDE_TILE`` for wide ones inside a graph capture)."""
    if not _gemv_fits(x, weight):
        return None
    if weight.shape[0] <= weight.shape[1]:
        return GEMV_TILE
    return GEMV_WIDE_TILE if torch.cuda.is_current_stream_capturing() else None


def _gemv_fits(x: Any, weight: Any) -> bool:
    """Whether the GEMV can run ``x @ weight.T``: one bf16/fp16 row against a plain weight of its dtype."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.is_cuda
        and weight.dtype in _GEMV_DTYPES
        and x.dtype == weight.dtype
        and x.numel() == weight.shape[1]
    )


def linear_norm_tile(setting: str) -> dict[str, int] | None:
    """:data:`LINEAR_NORM_ENV`'s tile: None for ``0`` (off), the narrow GEMV tile for ``1``, else ``block_n,block_k,
    num_warps`` with two tiles ahead of the PDL wait.

    Raises:
        ValueError: for anything else.
    """
    setting = setting.strip()
    if setting in ("", "0"):
        return None
    if setting == "1":
        return dict(GEMV_TILE)
    try:
        block_n, block_k, warps = (int(v) for v in setting.split(","))
    except ValueError:
        raise ValueError(f"{LINEAR_NORM_ENV} is 0, 1 or block_n,block_k,num_warps, not {setting!r}") from None
    return {"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": 2, "prefetch": 2}
