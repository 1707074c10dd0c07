"""The one switch between torch_npu's kernels and their CPU reference substitute.

``ENGINE_ASCEND_KERNELS`` selects the kernel module every Ascend backend calls:

- unset or ``torch_npu``: :mod:`engine_plugin_ascend.npu_kernels`, the real NPU kernels (production);
- ``reference``: :mod:`engine_plugin_ascend.reference_kernels`, float reference implementations with
  the same signatures, on CPU tensors. **For testing only**: it lets the conformance suite run all the
  glue around the kernels on a machine without an NPU, and it verifies nothing about the NPU kernels.

Both modules expose the same functions (checked by the plugin's tests); nothing else in the plugin
knows which one it got.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

KERNELS_ENV = "ENGINE_ASCEND_KERNELS"
NPU_KERNELS = "torch_npu"
REFERENCE_KERNELS = "reference"
_MODULES = {
    NPU_KERNELS: "engine_plugin_ascend.npu_kernels",
    REFERENCE_KERNELS: "engine_plugin_ascend.reference_kernels",
}

#: the functions (and constants) both kernel modules define
KERNEL_API = (
    "DEVICE_TYPE",
    "COMMUNICATOR_BACKEND",
    "reshape_and_cache",
    "fused_infer_attention_score",
    "rms_norm",
    "add_rms_norm",
    "rotary_mul",
    "swiglu",
    "capture_graph",
    "replay_graph",
    "torch_device",
    "mem_get_info",
    "synchronize",
    "manual_seed",
)


def selected_kernels(environ: Mapping[str, str]) -> str:
    """The kernel implementation ``environ`` asks for.

    Raises:
        ValueError: for a value other than ``torch_npu`` or ``reference``.
    """
    value = environ.get(KERNELS_ENV, "").strip() or NPU_KERNELS
    if value not in _MODULES:
        raise ValueError(f"{KERNELS_ENV}={value!r} is not one of {sorted(_MODULES)}")
    return value


def load_kernels(name: str) -> ModuleType:
    """Import the kernel module called ``name`` (see :func:`selected_kernels`).

    Importing :mod:`engine_plugin_ascend.npu_kernels` does not import torch_npu; its functions do.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in _MODULES:
        raise ValueError(f"unknown Ascend kernel implementation {name!r}; known: {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name])
