"""The decode attention kernel's registers on Hopper, compiled on this machine (Triton's bundled tools, no GPU
needed): over an FP8 cache its softmax and addressing, not its bytes, bound it, so how many programs share an SM
is its speed. At 4 warps a program, three fit an SM's 65,536 registers at 168 a thread or fewer, two above
(session 44: the two-KV-head kernel held 203 before each head's tile was read just before its own product, 150
after). The compile runs in a process of its own: this test process has Triton in interpreter mode."""

from __future__ import annotations

from pathlib import Path

from test_fragment_kernel_compiles import run_probe

PROBE = Path(__file__).with_name("decode_compile_probe.py")
#: the most registers a thread at which three 4-warp programs fit an SM
THREE_PROGRAMS = 65536 // (3 * 128) // 8 * 8


def test_decode_kernel_fits_three_programs_an_sm() -> None:
    registers = run_probe(PROBE)
    assert set(registers) == {"fp8 two heads", "bf16 one head"}, registers
    assert all(n <= THREE_PROGRAMS for n in registers.values()), registers
