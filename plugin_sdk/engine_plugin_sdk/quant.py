"""Quantized test weights in the storage layouts the plugin API names, each with its own ``dequantize``.

Scheme names and layouts (``QuantizedWeight.data`` / ``extra``):

- ``gguf_<type>`` (``gguf_q4_0``, ``gguf_q8_0``, ...): ``data`` is a ``torch.uint8`` tensor
  ``[out_features, bytes_per_row]`` holding GGUF blocks row by row; ``extra["ggml_type"]`` is the
  ``gguf.GGMLQuantizationType`` value. ``gguf_q2_k`` .. ``gguf_q6_k``, ``gguf_iq4_nl`` and ``gguf_iq4_xs``, which the
  gguf package cannot quantize, are random valid blocks; every GGUF type dequantizes through gguf's reference.
- ``int8``: symmetric per-output-channel; ``data`` is ``torch.int8 [out, in]``, ``extra["scale"]`` float32 ``[out]``;
  the weight is ``data * scale[:, None]``.
- ``int4_grouped`` / ``int8_grouped``: weight-only codes with group-wise scales and zero points and an
  optional act-order column permutation, the layout GPTQ / AWQ / compressed-tensors checkpoints are
  repacked into (``engine.interfaces.grouped_int`` documents it). Test weights use groups of 128 (32
  when ``in_features`` is below 256), asymmetric zero points and a random column order.
- ``fp8_e4m3``: ``data`` is ``torch.float8_e4m3fn [out, in]``, ``extra["scale"]`` float32 ``[out]``, same formula.
  Weights the engine quantizes at load (``quantization="fp8"``) also carry ``extra["activations"] ==
  "per_token"``: a hint that single-term per-row FP8 activations (W8A8) are acceptable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.interfaces.grouped_int import GROUPED_INT_BITS, grouped_int_weight

SCALED_SCHEMES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
GGUF_PREFIX = "gguf_"
#: K-quants the gguf package cannot quantize: their test weights are random valid blocks instead
#: (super-block bytes; scale fields drawn small so that the weights stay O(1 / sqrt(in)))
RANDOM_BLOCK_SCHEMES = {
    "gguf_q4_k": 144, "gguf_q5_k": 176, "gguf_q6_k": 210, "gguf_q3_k": 110, "gguf_q2_k": 84, "gguf_iq4_xs": 136,
    "gguf_iq4_nl": 18,
}  # fmt: skip
#: values a block of those that are not 256
RANDOM_BLOCK_VALUES = {"gguf_iq4_nl": 32}


class UnknownSchemeError(ValueError):
    """The SDK cannot build test weights of this scheme."""


def _gguf_type(scheme: str) -> object:
    import gguf

    name = scheme[len(GGUF_PREFIX) :].upper()
    try:
        return gguf.GGMLQuantizationType[name]
    except KeyError:
        raise UnknownSchemeError(f"unknown GGUF quantization type in scheme {scheme!r}") from None


def make_quantized_weight(
    scheme: str, out_features: int, in_features: int, seed: int = 0, device: str | torch.device = "cpu"
) -> QuantizedWeight:
    """A random weight quantized with ``scheme``.

    Args:
        scheme: see the module docstring.
        out_features: rows.
        in_features: columns; a multiple of the scheme's block size (256 covers every GGUF type).
        seed: random seed.
        device: where ``data`` (and scales) live; ``dequantize`` returns a float32 tensor there too.

    Returns:
        The :class:`QuantizedWeight`.

    Raises:
        UnknownSchemeError: for a scheme the SDK cannot produce (the suite reports it as not runnable here).
    """
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    device = torch.device(device)
    if scheme in SCALED_SCHEMES:
        storage = SCALED_SCHEMES[scheme]
        top = 127.0 if storage == torch.int8 else 448.0
        scale = dense.abs().amax(dim=1).clamp_min(1e-8) / top
        scaled = dense / scale[:, None]
        data = scaled.round().to(storage) if storage == torch.int8 else scaled.to(storage)
        data, scale = data.to(device), scale.to(device)

        def dequantize_scaled() -> torch.Tensor:
            return data.float() * scale[:, None]

        return QuantizedWeight(scheme, data, (out_features, in_features), dequantize_scaled, {"scale": scale})
    if scheme in GROUPED_INT_BITS:
        return _grouped_int(scheme, dense, gen, device)
    if scheme.startswith(GGUF_PREFIX):
        from gguf import quants

        qtype = _gguf_type(scheme)
        if scheme in RANDOM_BLOCK_SCHEMES:
            data = _random_k_blocks(scheme, out_features, in_features, gen).to(device)
        else:
            try:
                raw = quants.quantize(dense.numpy(), qtype)
            except (NotImplementedError, quants.QuantError, ValueError) as exc:
                raise UnknownSchemeError(f"the gguf package cannot quantize to {scheme!r}: {exc}") from None
            data = torch.from_numpy(raw.copy()).view(torch.uint8).to(device)
        return QuantizedWeight(
            scheme,
            data,
            (out_features, in_features),
            _gguf_dequantizer(data, qtype, device),
            {"ggml_type": int(qtype)},
        )
    raise UnknownSchemeError(
        f"the SDK has no test-weight generator for quantization scheme {scheme!r} "
        f"(known: {sorted({*SCALED_SCHEMES, *GROUPED_INT_BITS})} and gguf_<type>)"
    )


def _grouped_int(scheme: str, dense: torch.Tensor, gen: torch.Generator, device: torch.device) -> QuantizedWeight:
    """``dense`` rounded to asymmetric grouped codes, its columns stored in a random (act-order) order."""
    bits = GROUPED_INT_BITS[scheme]
    out_features, in_features = dense.shape
    group = 128 if in_features >= 256 else 32
    if in_features % group:
        raise UnknownSchemeError(f"{scheme} test weights need a multiple of {group} columns, got {in_features}")
    perm = torch.randperm(in_features, generator=gen)
    groups = dense[:, perm].unflatten(1, (-1, group))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    top = 2**bits - 1
    scales = ((high - low) / top).clamp_min(1e-8)
    zeros = (-low / scales).round().clamp(0, top)
    codes = (groups / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, top).flatten(1)
    weight = grouped_int_weight(codes.to(torch.uint8), scales, zeros, group, bits, perm)
    weight.data = weight.data.to(device)
    weight.extra.update({k: v.to(device) for k, v in weight.extra.items() if isinstance(v, torch.Tensor)})
    return weight


def _random_k_blocks(scheme: str, out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF Q2_K .. Q6_K / IQ4_NL / IQ4_XS bytes ``[out, in / values * block_bytes]`` with finite, small
    scales.

    Raises:
        UnknownSchemeError: if ``in_features`` is not whole blocks (256 values, IQ4_NL's 32).
    """
    values = RANDOM_BLOCK_VALUES.get(scheme, 256)
    if in_features % values:
        raise UnknownSchemeError(f"{scheme} needs a multiple of {values} columns, got {in_features}")
    count = out_features * (in_features // values)
    blocks = torch.randint(0, 256, (count, RANDOM_BLOCK_SCHEMES[scheme]), generator=gen, dtype=torch.uint8)

    def halves(n: int, scale: float) -> torch.Tensor:
        return (torch.rand(count, n, generator=gen) * scale).to(torch.float16).view(torch.uint8)

    step = in_features**-0.5 / 64
    if scheme in ("gguf_q4_k", "gguf_q5_k"):  # d, dmin, 12 bytes of 6-bit scales/mins, (32 of high bits), nibbles
        blocks[:, 0:2] = halves(1, step)
        blocks[:, 2:4] = halves(1, step)
    elif scheme == "gguf_q3_k":  # 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales, d
        blocks[:, 108:110] = halves(1, step)
    elif scheme in ("gguf_iq4_nl", "gguf_iq4_xs"):  # d, (IQ4_XS: 6-bit scales in 2 + 4 bytes), nibbles
        blocks[:, 0:2] = halves(1, step if scheme == "gguf_iq4_nl" else step / 16)
    elif scheme == "gguf_q2_k":  # 16 bytes of 4-bit scales and mins, 64 of 2-bit quants, d, dmin
        blocks[:, 80:82] = halves(1, step * 4)
        blocks[:, 82:84] = halves(1, step * 4)
    else:  # 128 + 64 bytes of quants, 16 int8 scales, d
        blocks[:, 192:208] = torch.randint(-64, 64, (count, 16), generator=gen, dtype=torch.int8).view(torch.uint8)
        blocks[:, 208:210] = halves(1, step / 2)
    return blocks.reshape(out_features, -1)


def _gguf_dequantizer(data: torch.Tensor, qtype: object, device: torch.device) -> Callable[[], torch.Tensor]:
    def dequantize_gguf() -> torch.Tensor:
        from gguf import quants

        dense = quants.dequantize(data.cpu().numpy(), qtype)
        return torch.from_numpy(dense.copy()).float().to(device)

    return dequantize_gguf
