"""Load-time FP8 quantization (``quantization="fp8"``): per-channel scales and the W8A8 marker."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.loader.fp8 import (
    ACTIVATIONS_KEY,
    FP8_E4M3_MAX,
    FP8_E4M3_SCHEME,
    PER_TOKEN_ACTIVATIONS,
    quantize_fp8_per_channel,
)


def test_per_channel_scales_and_round_trip() -> None:
    gen = torch.Generator().manual_seed(11)
    # rows of very different magnitudes: each must keep its own scale
    weight = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    weight[5] = 0.0
    qw = quantize_fp8_per_channel(weight.to(torch.bfloat16))
    assert qw.scheme == FP8_E4M3_SCHEME and qw.shape == (64, 96)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.extra[ACTIVATIONS_KEY] == PER_TOKEN_ACTIVATIONS
    scale = qw.extra["scale"]
    amax = weight.to(torch.bfloat16).float().abs().amax(dim=1)
    assert scale[5] == 1.0 and torch.equal(qw.data[5].float(), torch.zeros(96))
    nonzero = amax > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / FP8_E4M3_MAX)
    # every row's largest element maps to the top of the format
    assert torch.equal(qw.data.float().abs().amax(dim=1)[nonzero], torch.full((63,), FP8_E4M3_MAX))
    # e4m3 keeps 3 mantissa bits: a normal value rounds within 1/16 of itself; the smallest ones land on
    # the subnormal grid (2^-9 of the scale)
    back = qw.dequantize()
    ref = weight.to(torch.bfloat16).float()
    bound = torch.maximum(ref.abs() / 16, scale[:, None] * 2.0**-10) * 1.0001
    assert ((back - ref).abs() <= bound).all()


@pytest.mark.parametrize("bad", [torch.ones(8), torch.ones(4, 4, dtype=torch.int32)])
def test_rejects_what_is_not_a_float_matrix(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="2-D float matrix"):
        quantize_fp8_per_channel(bad)


def test_config_spellings() -> None:
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "float8_e4m3fn"
    assert CacheConfig(kv_cache_dtype="auto").kv_cache_dtype is None
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError):
        EngineConfig(quantization="int3")


def _ct(activations: dict | None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}}


@pytest.mark.parametrize(
    "config, w8a8",
    [
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, True),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, True),
        (_ct({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}), True),
        (_ct({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}), True),
        (_ct(None), False),
    ],
)
def test_an_fp8_checkpoint_that_quantizes_activations_runs_w8a8(config: dict, w8a8: bool) -> None:
    """A checkpoint whose config quantizes activations to FP8 too gets the W8A8 marker on its FP8 weights
    (one FP8 term per activation row, the FP8 matmul rate); a weight-only FP8 checkpoint does not."""
    from engine.interfaces.gemm import ACTIVATIONS_KEY
    from engine.loader.prequantized.config import checkpoint_quantization
    from engine.loader.prequantized.formats import compressed_weight, fp8_weight

    quant = checkpoint_quantization(config, "ckpt")
    assert quant is not None and quant.fp8_activations is w8a8
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(5))
    scale = weight.abs().amax(dim=1) / FP8_E4M3_MAX
    parts = {"weight": (weight / scale[:, None]).to(torch.float8_e4m3fn), "weight_scale": scale}
    convert = fp8_weight if quant.method == "fp8" else compressed_weight
    qw = convert(parts, quant, "model.layers.0.mlp.up_proj.weight")
    assert qw.scheme == FP8_E4M3_SCHEME
    assert (qw.extra.get(ACTIVATIONS_KEY) == PER_TOKEN_ACTIVATIONS) is w8a8
    torch.testing.assert_close(qw.dequantize(), weight, atol=0.07 * float(scale.max()) * FP8_E4M3_MAX / 16, rtol=0.07)


def test_an_unknown_fp8_activation_scheme_is_one_line() -> None:
    from engine.loader import ModelLoadError
    from engine.loader.prequantized.config import checkpoint_quantization

    with pytest.raises(ModelLoadError, match="activation_scheme 'per_block' is not supported"):
        checkpoint_quantization({"quantization_config": {"quant_method": "fp8", "activation_scheme": "per_block"}}, "ckpt")
