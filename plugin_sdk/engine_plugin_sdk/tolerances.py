"""The one table of numerical tolerances the conformance suite holds every plugin to.

A plugin's result ``out`` passes against the float64 reference ``ref`` when, elementwise,
``|out - ref| <= atol + rtol * |ref|``. The inputs the suite builds keep outputs of order one, so
``atol`` is the figure that matters; it is a small multiple of the dtype's unit roundoff, loose enough
for fp32 accumulation in any order and tight enough that a wrong mask, scale or block lookup fails.

Changing a value here changes what every plugin is held to: it needs a minor plugin-API release note
(see docs/plugins.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Allowed elementwise error against the float64 reference.

    Attributes:
        atol: absolute error allowed.
        rtol: error allowed relative to the reference value.
        logits_atol: absolute error allowed on end-to-end logits (errors grow through the layers).
    """

    atol: float
    rtol: float
    logits_atol: float


#: per model/activation dtype; keys are the dtype names used in :class:`engine.interfaces.Capabilities`
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-10, rtol=1e-10, logits_atol=1e-8),
    "float32": Tolerance(atol=1e-4, rtol=1e-4, logits_atol=1e-3),
    "float16": Tolerance(atol=5e-3, rtol=5e-3, logits_atol=5e-2),
    "bfloat16": Tolerance(atol=3e-2, rtol=3e-2, logits_atol=2.5e-1),
}

#: extra error a quantized GEMM may add on top of its activation dtype's tolerance, for kernels that
#: also quantize the activations (as int8/q8 dot-product kernels do); relative to an output of order one
QUANTIZED_GEMM_EXTRA = Tolerance(atol=2e-2, rtol=2e-2, logits_atol=0.0)

#: extra error of activations quantized to one e4m3 term per row (the FP8 producer ops): half a step of
#: a 3-bit mantissa is 1/16 of the value, plus the subnormal steps near zero
FP8_ROWS_EXTRA = Tolerance(atol=1e-3, rtol=0.07, logits_atol=0.0)

#: KV cache dtypes narrower than the model dtype round the keys and values once more
KV_CACHE_TOLERANCES: dict[str, Tolerance] = {
    "float8_e4m3fn": Tolerance(atol=1e-1, rtol=1e-1, logits_atol=1.0),
    "float8_e5m2": Tolerance(atol=2e-1, rtol=2e-1, logits_atol=1.0),
}


def dtype_name(dtype: Any) -> str:
    """The name of a torch dtype or dtype name: ``torch.bfloat16`` and ``"bfloat16"`` both give ``"bfloat16"``."""
    if isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


def get_tolerance(dtype: Any, kv_cache_dtype: Any = None, quantized: bool = False) -> Tolerance:
    """The tolerance for results computed in ``dtype``.

    Args:
        dtype: the activation dtype (torch dtype or name).
        kv_cache_dtype: the KV cache dtype when it differs from ``dtype``; the looser of the two wins.
        quantized: add :data:`QUANTIZED_GEMM_EXTRA` for quantized weights.

    Returns:
        The :class:`Tolerance` to apply.

    Raises:
        KeyError: for a dtype the table does not list.
    """
    name = dtype_name(dtype)
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name!r}; known: {sorted(TOLERANCES)}")
    tol = TOLERANCES[name]
    if kv_cache_dtype is not None and dtype_name(kv_cache_dtype) != name:
        kv_name = dtype_name(kv_cache_dtype)
        kv_tol = KV_CACHE_TOLERANCES.get(kv_name) or TOLERANCES.get(kv_name)
        if kv_tol is None:
            raise KeyError(f"no tolerance for KV cache dtype {kv_name!r}")
        tol = Tolerance(
            max(tol.atol, kv_tol.atol), max(tol.rtol, kv_tol.rtol), max(tol.logits_atol, kv_tol.logits_atol)
        )
    if quantized:
        extra = QUANTIZED_GEMM_EXTRA
        tol = Tolerance(tol.atol + extra.atol, tol.rtol + extra.rtol, tol.logits_atol)
    return tol


def compare(actual: Any, expected: Any, tol: Tolerance, what: str) -> str:
    """Compare a result with its reference.

    Args:
        actual: the plugin's tensor (any dtype, any device).
        expected: the float64 reference tensor.
        tol: the tolerance.
        what: names the result in the message, e.g. ``"attention.decode output"``.

    Returns:
        ``""`` when within tolerance, else a one-line description of the worst mismatch.
    """
    import torch

    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return f"{what}: shape {tuple(a.shape)} differs from the reference shape {tuple(e.shape)}"
    if not torch.isfinite(a).all():
        return f"{what}: {int((~torch.isfinite(a)).sum())} non-finite values"
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    bad = err > bound
    if not bad.any():
        return ""
    worst = int(torch.argmax(err - bound))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
    return (
        f"{what}: {int(bad.sum())}/{a.numel()} elements out of tolerance (atol={tol.atol:g}, rtol={tol.rtol:g}); "
        f"worst at {idx}: got {a[idx].item():.6g}, expected {e[idx].item():.6g}, max abs error {err.max().item():.3g}"
    )
