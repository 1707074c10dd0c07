"""The AMD launch-parameter table for the shared Triton kernels, keyed by GPU architecture (``gfx...``).

On AMD, Triton's ``num_warps`` counts wavefronts: 64 lanes each on CDNA (Instinct), 32 on RDNA. So
four "warps" are 256 threads on CDNA, twice NVIDIA's, and the same register budget holds larger tiles
per program with fewer programs resident. The AMD backend software-pipelines through its stream
pipeliner with at most two stages and gains little from more; LDS (64 KiB per CU on CDNA2/3, 160 KiB on
CDNA4) rather than shared-memory carve-outs bounds the tile. None of these values has been measured on
AMD hardware yet (see the README): they are starting points chosen from those constraints.
"""

from __future__ import annotations

from engine_plugin_sdk.gpu.triton_kernels.launch import INTERPRETER_TUNING, AttentionTiles, KernelTuning

#: CDNA3 (MI300A/X, MI325X): 304 CUs on MI300X, 64 KiB LDS, wave64; matrix cores favour 128-row tiles
CDNA3_ARCHS = ("gfx940", "gfx941", "gfx942")
#: CDNA4 (MI350 / MI355X): 160 KiB LDS, OCP FP8 (e4m3fn) instead of the fnuz variants
CDNA4_ARCHS = ("gfx950",)
#: CDNA2 (MI210 / MI250X): wave64, 64 KiB LDS, no FP8
CDNA2_ARCHS = ("gfx90a",)
#: MI300-class parts whose FP8 is e4m3fnuz (exponent bias 8, no negative zero, max 240)
FP8_FNUZ_ARCHS = CDNA3_ARCHS
#: parts with OCP e4m3fn FP8 matrix instructions
FP8_OCP_ARCHS = CDNA4_ARCHS
WAVEFRONT_64_PREFIX = "gfx9"


def base_arch(gcn_arch_name: str) -> str:
    """``"gfx942"`` from torch's ``gcnArchName`` (``"gfx942:sramecc+:xnack-"``)."""
    return gcn_arch_name.split(":", 1)[0].strip().lower()


def wavefront_size(arch: str) -> int:
    """64 on GCN / CDNA (``gfx9*``), 32 on RDNA (``gfx10*``, ``gfx11*``, ``gfx12*``)."""
    return 64 if base_arch(arch).startswith(WAVEFRONT_64_PREFIX) else 32


def fp8_dtype_name(arch: str) -> str | None:
    """The torch FP8 e4m3 dtype the GPU's matrix cores take, or None without FP8 units."""
    arch = base_arch(arch)
    if arch in FP8_FNUZ_ARCHS:
        return "float8_e4m3fnuz"
    if arch in FP8_OCP_ARCHS:
        return "float8_e4m3fn"
    return None


def tuning_for_arch(arch: str, num_compute_units: int) -> KernelTuning:
    """Launch parameters for one AMD GPU.

    Args:
        arch: ``gcnArchName`` or its base (``"gfx942"``).
        num_compute_units: CUs on the device (sizes the decode context split).

    Returns:
        The :class:`KernelTuning` the shared launchers take.
    """
    arch = base_arch(arch)
    cus = max(1, num_compute_units)
    if arch in CDNA3_ARCHS or arch in CDNA4_ARCHS:
        return KernelTuning(
            num_compute_units=cus,
            prefill_small_head=AttentionTiles(128, 64, 4, 2),
            prefill_large_head=AttentionTiles(64, 32, 4, 1),
            decode_block_n=64,
            decode_num_warps=4,
            decode_num_stages=1,
            max_decode_splits=32,
        )
    if arch in CDNA2_ARCHS:
        return KernelTuning(
            num_compute_units=cus,
            prefill_small_head=AttentionTiles(64, 64, 4, 1),
            prefill_large_head=AttentionTiles(32, 32, 4, 1),
            decode_block_n=64,
            decode_num_warps=4,
            decode_num_stages=1,
        )
    # RDNA and unknown parts: wave32 and smaller register files, so the conservative tiles
    return KernelTuning(
        num_compute_units=cus,
        prefill_small_head=AttentionTiles(64, 32, 4, 1),
        prefill_large_head=AttentionTiles(32, 16, 4, 1),
        decode_block_n=32,
        decode_num_warps=4,
        decode_num_stages=1,
    )


#: what the interpreter runs with in CI: the CDNA3 tile *ratios* scaled down, so the wide-M prefill
#: tile and the single-stage decode loop are exercised while the interpreted programs stay quick
INTERPRETER_CDNA_TUNING = KernelTuning(
    num_compute_units=INTERPRETER_TUNING.num_compute_units,
    prefill_small_head=AttentionTiles(32, 16, 4, 2),
    prefill_large_head=AttentionTiles(16, 16, 4, 1),
    decode_block_n=16,
    decode_num_warps=4,
    decode_num_stages=1,
    max_decode_splits=INTERPRETER_TUNING.max_decode_splits,
    min_keys_per_split=INTERPRETER_TUNING.min_keys_per_split,
)


def tuning_for_device(interpret: bool) -> KernelTuning:
    """Launch parameters for GPU 0 (asks torch for its architecture and CU count), or the interpreter's."""
    if interpret:
        return INTERPRETER_CDNA_TUNING
    import torch

    props = torch.cuda.get_device_properties(0)
    return tuning_for_arch(getattr(props, "gcnArchName", ""), props.multi_processor_count)
