"""A few PTX integer instructions run in Python, for the inline asm of the integer-dot GEMV: the interpreter runs
that kernel's emulation in plain Triton ops, so only this shows that the asm's registers meet the operands the
kernel hands it (``$0 ..`` the outputs, then each argument's registers in order)."""

from __future__ import annotations

import re

MASK = 0xFFFFFFFF


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def run_ptx(asm: str, inputs: list[int], outputs: int) -> list[int]:
    """The ``outputs`` 32-bit results of ``asm`` (a ``{ ... }`` block of ``mov``, ``and``, ``or``, ``shl``, ``shr``,
    ``mad.lo.s32`` and ``dp2a.{lo,hi}.s32.u32``) with ``$outputs ..`` holding ``inputs`` (unsigned 32-bit).

    Raises:
        ValueError: for an instruction outside that set.
    """
    regs: dict[str, int] = {f"${outputs + i}": v & MASK for i, v in enumerate(inputs)}

    def value(operand: str) -> int:
        operand = operand.strip()
        if operand in regs:
            return regs[operand]
        return int(operand, 0) & MASK

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        dst, *src = [part.strip() for part in rest.split(",")]
        a = [value(s) for s in src]
        if op == "mov.b32":
            result = a[0]
        elif op == "and.b32":
            result = a[0] & a[1]
        elif op == "or.b32":
            result = a[0] | a[1]
        elif op == "shl.b32":
            result = a[0] << a[1]
        elif op == "shr.b32":
            result = a[0] >> a[1]
        elif op == "mad.lo.s32":
            result = a[0] * a[1] + a[2]
        elif (match := re.fullmatch(r"dp2a\.(lo|hi)\.s32\.u32", op)) is not None:
            first = 0 if match.group(1) == "lo" else 2
            pair = [_signed(a[0], 16), _signed(a[0] >> 16, 16)]
            codes = [(a[1] >> (8 * (first + i))) & 0xFF for i in range(2)]
            result = pair[0] * codes[0] + pair[1] * codes[1] + _signed(a[2], 32)
        else:
            raise ValueError(f"no emulation of {op!r}")
        regs[dst] = result & MASK
    return [_signed(regs[f"${i}"], 32) for i in range(outputs)]
