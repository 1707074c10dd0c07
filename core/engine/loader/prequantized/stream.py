"""Regroup a pre-quantized checkpoint's tensor stream: each quantized matrix's parts (``qweight``,
``scales``, ``weight_packed``, ``weight_scale``, ...) become one ``{module}.weight`` in the plugin API's
layouts, kept quantized where the platform's GEMM runs the scheme and dequantized otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.errors import ModelLoadError
from engine.loader.lazy_tensor import materialize
from engine.loader.prequantized.config import CheckpointQuantization
from engine.loader.prequantized.formats import awq_weight, compressed_weight, fp8_weight, gptq_weight

#: per method: the suffixes of a quantized matrix's parts, the one every such matrix has, and its builder
_PARTS: dict[str, tuple[tuple[str, ...], str, Callable[..., Any]]] = {
    "gptq": (("qweight", "qzeros", "scales", "g_idx"), "qweight", gptq_weight),
    "awq": (("qweight", "qzeros", "scales"), "qweight", awq_weight),
    "compressed-tensors": (
        ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "weight"),
        "weight_scale",
        compressed_weight,
    ),
    "fp8": (("weight", "weight_scale", "weight_scale_inv"), "weight", fp8_weight),
}
#: calibrated scales the engine does not use: activations are quantized per row as they come, and the KV
#: cache's FP8 scales are the engine's own
_UNUSED = ("input_scale", "input_zero_point", "k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")
#: storage dtypes of a ``weight`` that is one part of a quantized matrix
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


def regroup_quantized(
    weights: Iterable[tuple[str, Any]],
    quant: CheckpointQuantization,
    keep_quantized: frozenset[str],
    expected: Iterable[str],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Pass a checkpoint's float tensors through and rebuild its quantized matrices.

    Args:
        weights: (HF name, tensor) pairs of the checkpoint.
        quant: the checkpoint's quantization.
        keep_quantized: schemes the platform's GEMM runs quantized; other matrices are dequantized to
            float32 here.
        expected: the names the model loads: a quantized module's all-zero ``bias`` that the model has
            no place for (GPTQ tools write one for every layer) is dropped.

    Returns:
        (name, tensor) pairs with each quantized matrix as ``{module}.weight``, after the float tensors.

    Raises:
        ModelLoadError: a quantized matrix lacks a part, or its parts do not fit together.
    """
    suffixes, marker, build = _PARTS[quant.method]
    expected = set(expected)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    biases: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix in _UNUSED:
            continue
        if suffix == "bias" and name not in expected:
            biases[module] = materialize(tensor)
            continue
        if suffix in suffixes and (suffix != "weight" or tensor.dtype in _QUANTIZED_DTYPES):
            parts.setdefault(module, {})[suffix] = materialize(tensor)
            continue
        yield name, tensor
    for module, bias in biases.items():
        if module not in parts or bool(bias.any()):
            yield module + ".bias", bias  # the shape check names it
    for module, found in parts.items():
        name = module + ".weight"
        if marker not in found:
            raise ModelLoadError(f"quantized tensor '{name}' lacks its {marker!r} ({quant.method} checkpoint)")
        try:
            weight = build(found, quant, name)
        except KeyError as missing:
            raise ModelLoadError(f"quantized tensor '{name}' lacks its {missing.args[0]!r} ({quant.method} checkpoint)") from None
        except (RuntimeError, ValueError) as err:
            raise ModelLoadError(f"quantized tensor '{name}' ({quant.method}) is malformed: {err}") from None
        if isinstance(weight, QuantizedWeight) and weight.scheme not in keep_quantized:
            weight = weight.dequantize()
        yield name, weight
