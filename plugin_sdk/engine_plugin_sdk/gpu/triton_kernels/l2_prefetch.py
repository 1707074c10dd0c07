"""Asking the L2 cache for lines a kernel will read later, without holding registers for them (NVIDIA PTX).

A loop bound by its loads' latency keeps more bytes in flight either in registers (a read-ahead: registers a
lane for every chunk) or in shared memory (``cp.async`` stages, with barriers): ``prefetch.global.L2`` does it
with neither, and the later load then waits for the L2 cache instead of the memory. The interpreter cannot
run PTX; there (``ASM`` off) nothing is prefetched, which changes no result.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, ok, ASM: tl.constexpr):
    """Ask the L2 cache to fetch the lines holding ``ptrs`` where ``ok`` (any shape, broadcast; the addresses
    where ``ok`` must be valid). Nothing is returned; without ``ASM`` a no-op."""
    if ASM:
        # the result is a dummy (inline asm must return one); not pure, so the compiler keeps the instruction
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )

