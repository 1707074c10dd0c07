"""Grouped-integer weights (``int4_grouped`` / ``int8_grouped``, GPTQ / AWQ / compressed-tensors) as GGUF blocks.

The packed GEMM kernels take GGUF Q4_0, Q4_1 and Q8_0 (``gemm.PACKED_SCHEMES``), whose blocks are 32
consecutive input columns with one fp16 scale (Q4_1: and an fp16 minimum). A grouped-int weight maps onto
them exactly when:

- it has no act-order ``perm``: the kernels multiply stored column ``j`` by input feature ``j``, and
  undoing a permutation would scatter every group's columns over many blocks;
- ``group_size`` is a multiple of 32, so that every block lies inside one group and takes its parameters;
- the block parameters are exact in fp16: ``d = scale`` and, for 4-bit, ``m = -zero * scale`` (Q4_1's
  minimum, and the C kernels' ``-8 d`` for Q4_0, so it must not overflow either);
- for 8-bit, the zero point is 128 (Q8_0 has no minimum).

Then int4 with every zero point 8 becomes Q4_0 (``d * (q - 8)``), other int4 becomes Q4_1
(``d * q + m``), and symmetric int8 becomes Q8_0 (``d * (q - 128)`` as signed bytes); with integer zero
points each repacked value equals the layout's ``(code - zero) * scale`` in float32 (the products have
at most 11 + 8 significant bits). Anything else is left to the caller's dequantizing fallback.
"""

from __future__ import annotations

import logging

import torch

from engine_plugin_cpu.quant_pack import GGUF_BLOCK
from engine_plugin_sdk import INT4_GROUPED, INT8_GROUPED, QuantizedWeight, grouped_int_codes

logger = logging.getLogger(__name__)

#: zero point of a symmetric checkpoint, in code units, by scheme
SYMMETRIC_ZERO = {INT4_GROUPED: 8.0, INT8_GROUPED: 128.0}


def repack_grouped_as_gguf(weight: QuantizedWeight) -> QuantizedWeight | None:
    """A grouped-int weight as GGUF Q4_0 / Q4_1 / Q8_0 bytes, or None where it does not map exactly.

    Args:
        weight: an ``int4_grouped`` or ``int8_grouped`` weight (``engine_plugin_sdk.grouped_int_weight``).

    Returns:
        A ``gguf_q4_0``, ``gguf_q4_1`` or ``gguf_q8_0`` weight on the CPU with the same logical matrix
        (its ``dequantize`` is the original's), or None when the module docstring's conditions fail;
        the reason is logged at debug level.

    Raises:
        ValueError: for a scheme other than the two grouped-int ones.
    """
    reason = _refusal(weight)
    if reason is not None:
        logger.debug("%s weight %s kept for dequantization: %s", weight.scheme, tuple(weight.shape), reason)
        return None
    out, width = (int(d) for d in weight.shape)
    group = int(weight.extra["group_size"])
    # one parameter per 32-column block: each group spans group / 32 blocks
    per_block = group // GGUF_BLOCK
    scales = weight.extra["scales"].to("cpu", torch.float32).repeat_interleave(per_block, dim=1)
    zeros = weight.extra["zeros"].to("cpu", torch.float32).repeat_interleave(per_block, dim=1)
    codes = grouped_int_codes(weight).to("cpu").reshape(out, width // GGUF_BLOCK, GGUF_BLOCK)
    d = _fp16_bytes(scales)
    if weight.scheme == INT8_GROUPED:
        signed = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        scheme, blocks = "gguf_q8_0", torch.cat([d, signed], dim=-1)
    else:
        # GGUF's nibble order: byte j of a block holds weight j (low nibble) and weight j + 16 (high)
        half = GGUF_BLOCK // 2
        qs = codes[..., :half] | (codes[..., half:] << 4)
        if bool((zeros == SYMMETRIC_ZERO[INT4_GROUPED]).all()):
            scheme, blocks = "gguf_q4_0", torch.cat([d, qs], dim=-1)
        else:
            scheme, blocks = "gguf_q4_1", torch.cat([d, _fp16_bytes(-zeros * scales), qs], dim=-1)
    data = blocks.reshape(out, -1).contiguous()
    return QuantizedWeight(scheme, data, (out, width), weight.dequantize, {})


def _refusal(weight: QuantizedWeight) -> str | None:
    """Why ``weight`` cannot be repacked exactly, or None if it can.

    Raises:
        ValueError: for a scheme other than the two grouped-int ones.
    """
    if weight.scheme not in SYMMETRIC_ZERO:
        raise ValueError(f"not a grouped-int weight: scheme {weight.scheme!r}")
    if weight.extra.get("perm") is not None:
        return "act-order column permutation"
    group = int(weight.extra["group_size"])
    if group % GGUF_BLOCK:
        return f"group size {group} is not a multiple of {GGUF_BLOCK}"
    scales = weight.extra["scales"].to("cpu", torch.float32)
    zeros = weight.extra["zeros"].to("cpu", torch.float32)
    if not _exact_in_fp16(scales):
        return "scales not exact in fp16"
    if weight.scheme == INT8_GROUPED:
        if not bool((zeros == SYMMETRIC_ZERO[INT8_GROUPED]).all()):
            return "asymmetric 8-bit zero points (Q8_0 has no minimum)"
    elif not _exact_in_fp16(-zeros * scales):
        return "minima -zero * scale not exact in fp16"
    return None


def _exact_in_fp16(values: torch.Tensor) -> bool:
    """Whether every float32 value is finite and survives a round trip through fp16 unchanged."""
    return bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values)


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, blocks]`` as their fp16 bytes ``[out, blocks, 2]`` (host order, as GGUF reads them)."""
    return values.half().unsqueeze(-1).contiguous().view(torch.uint8)
