"""One matrix of each pre-quantized format turned into the plugin API's layouts: grouped integers
(``engine.interfaces.grouped_int``) for GPTQ, AWQ and compressed-tensors ``pack-quantized``; ``fp8_e4m3``
and ``int8`` with per-row scales for FP8 and INT8 checkpoints; a float matrix where no layout fits
(block-wise FP8 scales, asymmetric INT8)."""

from __future__ import annotations

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import grouped_int_weight
from engine.loader.errors import ModelLoadError
from engine.loader.fp8 import ACTIVATIONS_KEY, FP8_E4M3_SCHEME, PER_TOKEN_ACTIVATIONS
from engine.loader.prequantized.config import CheckpointQuantization
from engine.loader.prequantized.int_packing import act_order, undo_awq_order, unpack_int32

#: tensors of one matrix by their suffix (after the module name)
Parts = dict[str, torch.Tensor]


def _group(quant: CheckpointQuantization, in_features: int) -> int:
    return in_features if quant.group_size in (-1, 0) else quant.group_size


def _grouped(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, bits: int,
             g_idx: torch.Tensor | None, name: str) -> QuantizedWeight:  # fmt: skip
    """``codes [out, in]`` in input order with per-group ``scales`` / ``zeros`` ``[out, groups]``."""
    perm = act_order(g_idx, codes.shape[1], group, name)
    if perm is not None:
        codes = codes[:, perm]
    return grouped_int_weight(codes.to(torch.uint8), scales.float(), zeros.float(), group, bits, perm)


def gptq_weight(parts: Parts, quant: CheckpointQuantization, name: str) -> QuantizedWeight:
    """GPTQ: ``qweight [in * bits / 32, out]`` packed along the input, ``qzeros [groups, out * bits / 32]``
    along the output (minus one in the original format), ``scales [groups, out]``, ``g_idx [in]``."""
    bits = quant.bits
    codes = unpack_int32(parts["qweight"], bits, dim=0).T  # [out, in]
    zeros = unpack_int32(parts["qzeros"], bits, dim=1)[:, : codes.shape[0]]
    if quant.zeros_minus_one:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    group = _group(quant, codes.shape[1])
    return _grouped(codes, parts["scales"].T, zeros.T, group, bits, parts.get("g_idx"), name)


def awq_weight(parts: Parts, quant: CheckpointQuantization, name: str) -> QuantizedWeight:
    """AWQ (GEMM): ``qweight [in, out / 8]`` and ``qzeros [groups, out / 8]`` packed along the output in
    AWQ's word order, ``scales [groups, out]``."""
    codes = undo_awq_order(unpack_int32(parts["qweight"], 4, dim=1)).T
    zeros = undo_awq_order(unpack_int32(parts["qzeros"], 4, dim=1)).T
    return _grouped(codes, parts["scales"].T, zeros, _group(quant, codes.shape[1]), 4, None, name)


def compressed_weight(parts: Parts, quant: CheckpointQuantization, name: str) -> QuantizedWeight | torch.Tensor:
    """compressed-tensors: ``pack-quantized`` (``weight_packed [out, in * bits / 32]``, signed codes stored
    with an offset of ``2**(bits-1)``, ``weight_scale [out, groups]``, optional packed
    ``weight_zero_point`` and ``weight_g_idx``), ``float-quantized`` / ``int-quantized`` / ``naive-quantized``
    (``weight`` in FP8 / int8 with a per-tensor, per-channel or per-group ``weight_scale``)."""
    scale = parts["weight_scale"]
    if quant.format == "pack-quantized":
        bits = quant.bits
        codes = unpack_int32(parts["weight_packed"], bits, dim=1)
        out_features = int(parts["weight_shape"][0]) if "weight_shape" in parts else codes.shape[0]
        in_features = int(parts["weight_shape"][1]) if "weight_shape" in parts else codes.shape[1]
        codes = codes[:out_features, :in_features]
        offset = 1 << (bits - 1)
        if "weight_zero_point" in parts:
            zeros = unpack_int32(parts["weight_zero_point"], bits, dim=0)[:out_features]
        else:
            zeros = torch.full(scale.shape, offset)
        scale = scale.reshape(out_features, -1)
        group = in_features // scale.shape[1]
        return _grouped(codes, scale, zeros.reshape(scale.shape), group, bits, parts.get("weight_g_idx"), name)
    weight = parts["weight"]
    zero_point = parts.get("weight_zero_point")
    if zero_point is not None and bool((zero_point != 0).any()):
        return _dense_grouped(weight.float() - _per_column(zero_point.float(), weight.shape), scale, weight.shape)
    if weight.dtype == torch.float8_e4m3fn:
        return _scaled(FP8_E4M3_SCHEME, weight, scale, quant.fp8_activations)
    if weight.dtype == torch.int8:
        return _scaled("int8", weight, scale)
    raise ModelLoadError(f"tensor '{name}': compressed-tensors weight of dtype {weight.dtype} is not supported")


def fp8_weight(parts: Parts, quant: CheckpointQuantization, name: str) -> QuantizedWeight | torch.Tensor:
    """An FP8 checkpoint's matrix: ``weight`` e4m3 with a per-tensor or per-channel ``weight_scale``, or
    block-wise ``weight_scale_inv`` (``weight_block_size``, DeepSeek-V3), dequantized to float here."""
    weight = parts["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"tensor '{name}' of an FP8 checkpoint is {weight.dtype}, expected float8_e4m3fn")
    if "weight_scale_inv" in parts:
        if quant.block_size is None:
            raise ModelLoadError(f"tensor '{name}' has block scales but the config gives no weight_block_size")
        rows, cols = quant.block_size
        scale = parts["weight_scale_inv"].float()
        expanded = scale.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(cols, 1)[:, : weight.shape[1]]
        return weight.float() * expanded
    return _scaled(FP8_E4M3_SCHEME, weight, parts["weight_scale"], quant.fp8_activations)


def _per_column(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-tensor, per-row or per-group parameters broadcast to ``shape``'s columns."""
    out_features, in_features = shape
    values = values.reshape(out_features, -1) if values.numel() > 1 else values.reshape(1, 1).expand(out_features, 1)
    return values.repeat_interleave(in_features // values.shape[1], dim=1)


def _dense_grouped(centred: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return centred * _per_column(scale.float(), shape)


def _scaled(
    scheme: str, weight: torch.Tensor, scale: torch.Tensor, fp8_activations: bool = False
) -> QuantizedWeight | torch.Tensor:
    """``weight * scale`` with one scale per tensor or per row as ``scheme``; other scales: float.
    ``fp8_activations`` marks the weight's activations for one FP8 term per row (W8A8)."""
    out_features, in_features = weight.shape
    if scale.numel() not in (1, out_features):
        return _dense_grouped(weight.float(), scale, weight.shape)
    rows = scale.float().reshape(-1).expand(out_features).contiguous()
    data = weight

    def dequantize() -> torch.Tensor:
        return data.float() * rows[:, None]

    extra: dict[str, object] = {"scale": rows}
    if fp8_activations:
        extra[ACTIVATIONS_KEY] = PER_TOKEN_ACTIVATIONS
    return QuantizedWeight(scheme, data, (int(out_features), int(in_features)), dequantize, extra)
