"""Asking the L2 cache for lines a kernel will read later, without holding registers for them (NVIDIA PTX).

A loop bound by its loads' latency keeps more bytes in flight either in registers (a read-ahead: registers a
lane for every chunk) or in shared memory (``cp.async`` stages, with barriers): ``prefetch.global.L2`` does it
with neither, and the later load then waits for the L2 cache instead of the memory. The interpreter cannot
run PTX; there (``ASM`` off) nothing is prefetched, which changes no result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_plugin_sdk.gpu.triton_kernels.launch import next_power_of_2


@triton.jit
def prefetch_l2(ptrs, ok, ASM: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    """Ask the L2 cache to fetch the lines holding ``ptrs`` where ``ok`` (any shape, broadcast; the addresses
    where ``ok`` must be valid), ``EVICT_LAST`` to keep them past lines read once. Nothing is returned; without
    ``ASM`` a no-op."""
    if ASM:
        # the result is a dummy (inline asm must return one); not pure, so the compiler keeps the instruction
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p prefetch.global.L2::evict_last [$1];\n\t"
                "mov.u32 $0, 0;\n\t}",
                "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;\n\t}",
                "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
            )



@triton.jit
def ask_l2_share(l2_ptr, l2_lines, L2_LINES: tl.constexpr, ASM: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    """This program's ``L2_LINES`` of the ``l2_lines`` 128-byte lines at ``l2_ptr`` (bytes), asked of the L2 cache
    (the programs in launch order, over a grid of up to three axes; ``EVICT_LAST`` as for :func:`prefetch_l2`)."""
    program = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    lines = program.to(tl.int64) * L2_LINES + tl.arange(0, L2_LINES)
    prefetch_l2(l2_ptr + lines * 128, lines < l2_lines, ASM, EVICT_LAST)


def l2_share_args(ahead: torch.Tensor | None, programs: int, on_gpu: bool) -> dict:
    """A kernel's arguments (``l2_ptr``, ``l2_lines``, ``L2_LINES``, ``L2_ASM``) that split the 128-byte lines of the
    contiguous tensor ``ahead`` among its ``programs`` for :func:`ask_l2_share`; none without it.

    Raises:
        ValueError: for a tensor that is not contiguous (a copy's lines would be asked for, not its own).
    """
    if ahead is None:
        return {}
    if not ahead.is_contiguous():
        raise ValueError("an L2 request takes a contiguous tensor")
    lines = -(-ahead.numel() * ahead.element_size() // 128)
    return {"l2_ptr": ahead.reshape(-1).view(torch.uint8), "l2_lines": lines,
            # PTX: a ROCm build's tensors are "cuda" too, and ask for nothing
            "L2_LINES": next_power_of_2(-(-lines // programs)), "L2_ASM": on_gpu and torch.version.hip is None}  # fmt: skip
