"""Quantized test weights in the storage layouts the plugin API names, each with its own ``dequantize``.

Scheme names and layouts (``QuantizedWeight.data`` / ``extra``):

- ``gguf_<type>`` (``gguf_q4_0``, ``gguf_q8_0``, ...): ``data`` is a ``torch.uint8`` tensor
  ``[out_features, bytes_per_row]`` holding GGUF blocks row by row; ``extra["ggml_type"]`` is the
  ``gguf.GGMLQuantizationType`` value.
- ``int8``: symmetric per-output-channel; ``data`` is ``torch.int8 [out, in]``, ``extra["scale"]`` float32 ``[out]``;
  the weight is ``data * scale[:, None]``.
- ``fp8_e4m3``: ``data`` is ``torch.float8_e4m3fn [out, in]``, ``extra["scale"]`` float32 ``[out]``, same formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.interfaces.gemm import QuantizedWeight

SCALED_SCHEMES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
GGUF_PREFIX = "gguf_"


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
    if scheme.startswith(GGUF_PREFIX):
        from gguf import quants

        qtype = _gguf_type(scheme)
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
        f"(known: {sorted(SCALED_SCHEMES)} and gguf_<type>)"
    )


def _gguf_dequantizer(data: torch.Tensor, qtype: object, device: torch.device) -> Callable[[], torch.Tensor]:
    def dequantize_gguf() -> torch.Tensor:
        from gguf import quants

        dense = quants.dequantize(data.cpu().numpy(), qtype)
        return torch.from_numpy(dense.copy()).float().to(device)

    return dequantize_gguf
