"""The torch/JAX boundary: dtype names and zero-copy (DLPack) conversion where the runtime allows it.

The core and the conformance suite hand backends torch tensors; this plugin computes on JAX arrays.
Every interface method therefore accepts either, converts torch inputs here, and answers in the kind
it was given (torch in, torch out), so the suite's torch-based checks apply unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

#: dtype names this plugin maps between torch and JAX
_JAX_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int32": jnp.int32,
    "int64": jnp.int64,
}


def dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``, ``jnp.bfloat16``, ``np.dtype('bfloat16')`` or the name itself."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def jax_dtype(dtype: Any) -> Any:
    """The JAX dtype for a torch dtype, a JAX/numpy dtype or a name.

    Raises:
        ValueError: for a dtype this plugin does not run.
    """
    name = dtype_name(dtype)
    if name not in _JAX_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported by the TPU/JAX plugin (supported: {sorted(_JAX_DTYPES)})")
    return _JAX_DTYPES[name]


def to_jax(x: Any) -> jax.Array:
    """A JAX array for a torch tensor (DLPack, zero-copy on the CPU), numpy array or JAX array.

    int64 stays int64 only when JAX runs with x64 enabled; otherwise JAX narrows it to int32, which is
    what its kernels index with anyway.
    """
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.int64:
            # DLPack would hand JAX a 64-bit buffer it cannot keep without x64; go through numpy instead
            return jnp.asarray(t.numpy().astype(np.int32) if not jax.config.jax_enable_x64 else t.numpy())
        try:
            return jnp.from_dlpack(t)
        except (TypeError, RuntimeError, BufferError):
            # some runtimes refuse a foreign buffer (alignment, device); a copy always works
            return jnp.asarray(t.float().numpy()).astype(jax_dtype(t.dtype))
    return jnp.asarray(x)


def to_torch(x: Any) -> torch.Tensor:
    """A torch CPU tensor for a JAX array (DLPack when it can, else through numpy)."""
    if isinstance(x, torch.Tensor):
        return x
    arr = jax.device_get(x) if isinstance(x, jax.Array) and not _on_cpu(x) else x
    try:
        return torch.from_dlpack(arr)
    except (TypeError, RuntimeError, BufferError):
        np_arr = np.asarray(arr)
        if np_arr.dtype.name == "bfloat16":
            return torch.from_numpy(np_arr.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(np_arr))


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.devices())


def host_int_array(x: Any, dtype: Any = np.int32) -> np.ndarray:
    """A host numpy integer array from a torch tensor, numpy array, list or JAX array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(dtype, copy=False)
    return np.asarray(x).astype(dtype, copy=False)
