"""The LM head's product over a quantized weight (a GGUF file's ``output.weight`` stays quantized where the
platform claims its type): ``GemmBackend.logits`` in float32 against the float64 reference, at one row (a
batch-1 decode step, which GPU backends run through a GEMV) and at several, for every claimed scheme."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_close, torch_dtype
from engine_conformance.pytest_plugin import not_claimed, not_runnable
from engine_plugin_sdk.quant import UnknownSchemeError, make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_quantized_linear
from engine_plugin_sdk.tolerances import get_tolerance

#: a vocabulary slice that is no multiple of a tile, over a hidden size every scheme's blocks divide
VOCAB, HIDDEN = 200, 512


@pytest.mark.capability("gemm.quant.{quant_scheme}.logits")
def test_quantized_logits(platform: Platform, caps: Capabilities, device: Any, quant_scheme: str) -> None:
    if quant_scheme == "any":
        not_claimed("no quantization schemes are claimed (weights are dequantized at load)")
    capability = f"gemm.quant.{quant_scheme}.logits"
    gemm = platform.make_gemm_backend()
    try:
        weight = make_quantized_weight(quant_scheme, VOCAB, HIDDEN, seed=71, device=device)
    except UnknownSchemeError as exc:
        not_runnable(str(exc))
    gen = torch.Generator().manual_seed(72)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        prepared = gemm.prepare_weight(weight, dtype)
        for rows in (1, 3):
            x = torch.randn(rows, HIDDEN, generator=gen).to(dtype).to(device)
            logits = gemm.logits(x, prepared)
            label = f"{capability} {dtype_name} M={rows}"
            if logits.dtype != torch.float32 or tuple(logits.shape) != (rows, VOCAB):
                pytest.fail(f"{label}: {logits.dtype} {tuple(logits.shape)}, expected float32 {(rows, VOCAB)}", pytrace=False)
            assert_close(logits, ref_quantized_linear(x, weight), get_tolerance(dtype, quantized=True), label)
