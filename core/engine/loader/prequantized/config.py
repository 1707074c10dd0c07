"""A checkpoint's ``quantization_config`` (config.json), read and checked once.

Each method is reduced to what the loader needs to rebuild the matrices; anything the engine does not
read exactly is refused here with a one-line reason, before a tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.loader.errors import ModelLoadError

#: the methods a checkpoint's ``quant_method`` may name
QuantMethod = Literal["gptq", "awq", "compressed-tensors", "fp8"]
METHODS: tuple[str, ...] = ("gptq", "awq", "compressed-tensors", "fp8")
#: the engine's ``quantization`` values that name a checkpoint's method (checked against its config)
PRE_QUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors")
#: compressed-tensors formats the loader reads
COMPRESSED_FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """How a checkpoint's matrices are stored.

    Attributes:
        method: the ``quant_method``.
        bits: bits per weight code (GPTQ, AWQ, compressed-tensors integer formats; 8 for FP8).
        group_size: columns per scale (-1: one group per row), where the method has groups.
        symmetric: GPTQ's ``sym`` (its zero points are still stored, and read).
        zeros_minus_one: GPTQ's original format stores each zero point minus one (``checkpoint_format``
            ``gptq``, the default); ``gptq_v2`` stores it as it is.
        format: compressed-tensors' ``format`` (``pack-quantized``, ``float-quantized``, ...).
        block_size: FP8 block-wise scales' ``[rows, cols]`` (``weight_block_size``), None for
            per-tensor or per-channel scales.
        fp8_activations: the checkpoint quantizes activations to FP8 too (W8A8: ``activation_scheme`` of
            an ``fp8`` config, FP8 ``input_activations`` of a compressed-tensors one, dynamic or static):
            its FP8 weights then take one FP8 term per activation row, quantized dynamically per token
            (a static per-tensor ``input_scale`` is not read: a token's own scale is at least as fine).
            False: weight-only FP8, the GEMM backend's more accurate default for the activations.
    """

    method: QuantMethod
    bits: int = 4
    group_size: int = -1
    symmetric: bool = True
    zeros_minus_one: bool = True
    format: str | None = None
    block_size: tuple[int, int] | None = None
    fp8_activations: bool = False


def checkpoint_quantization(hf_config: dict[str, Any], source: str) -> CheckpointQuantization | None:
    """The checkpoint's quantization, None for a float checkpoint.

    Args:
        hf_config: the raw config.json.
        source: the model path, for messages.

    Raises:
        ModelLoadError: an unknown method, or a setting the engine does not read exactly.
    """
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return None  # gpt-oss's MXFP4 experts: the model's own loader reads them
    if method not in METHODS:
        raise ModelLoadError(f"{source}: quantization method {method!r} is not supported (supported: {', '.join(METHODS)})")
    try:
        if method == "gptq":
            return _gptq(quant, source)
        if method == "awq":
            return _awq(quant, source)
        if method == "fp8":
            return _fp8(quant, source)
        return _compressed_tensors(quant, source)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{source}: malformed {method} quantization_config: {err}") from None


def _gptq(quant: dict[str, Any], source: str) -> CheckpointQuantization:
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    if bits not in (4, 8):
        raise ModelLoadError(f"{source}: GPTQ with {bits}-bit weights is not supported (supported: 4, 8)")
    fmt = quant.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    return CheckpointQuantization(
        "gptq", bits, group, bool(quant.get("sym", True)), zeros_minus_one=fmt == "gptq"
    )


def _awq(quant: dict[str, Any], source: str) -> CheckpointQuantization:
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    version = str(quant.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"{source}: AWQ {bits}-bit version {version!r} is not supported (supported: 4-bit gemm)")
    return CheckpointQuantization("awq", bits, group, symmetric=not quant.get("zero_point", True))


def _fp8(quant: dict[str, Any], source: str) -> CheckpointQuantization:
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) <= 0):
        raise ModelLoadError(f"{source}: FP8 weight_block_size must be two positive sizes, got {block}")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: FP8 activation_scheme {scheme!r} is not supported (supported: dynamic, static)")
    return CheckpointQuantization(
        "fp8", 8, block_size=None if block is None else (int(block[0]), int(block[1])), fp8_activations=True
    )


def _compressed_tensors(quant: dict[str, Any], source: str) -> CheckpointQuantization:
    fmt = quant.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise ModelLoadError(
            f"{source}: compressed-tensors format {fmt!r} is not supported (supported: {', '.join(COMPRESSED_FORMATS)})"
        )
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{source}: compressed-tensors quantization_config has no config_groups")
    weights = [group.get("weights") or {} for group in groups.values()]
    kinds = {(int(w.get("num_bits", 8)), w.get("type", "int")) for w in weights}
    if len(kinds) != 1:
        raise ModelLoadError(f"{source}: compressed-tensors groups with different weight types {sorted(kinds)} are not supported")
    (bits, kind), = kinds
    if fmt == "pack-quantized" and (kind != "int" or bits not in (4, 8)):
        raise ModelLoadError(f"{source}: pack-quantized {bits}-bit {kind} weights are not supported (supported: 4- and 8-bit int)")
    if fmt == "float-quantized" and (kind != "float" or bits != 8):
        raise ModelLoadError(f"{source}: float-quantized {bits}-bit {kind} weights are not supported (supported: FP8)")
    group = int(weights[0].get("group_size") or -1)
    inputs = [group.get("input_activations") or {} for group in groups.values()]
    fp8_inputs = fmt == "float-quantized" and all(
        a.get("type") == "float" and int(a.get("num_bits", 0)) == 8 for a in inputs
    )
    return CheckpointQuantization(
        "compressed-tensors", bits, group, bool(weights[0].get("symmetric", True)), format=fmt,
        fp8_activations=fp8_inputs,
    )  # fmt: skip
