"""Detecting an Ascend NPU cheaply, and saying in one sentence why there is none.

Detection never initialises the device: it looks for the torch_npu package without importing it,
then for the driver's device nodes (``/dev/davinci<N>``), and only then imports torch_npu (which
registers the device type but opens no device) to ask how many NPUs it can see. The three probes
below are the boundary the tests replace.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
from types import ModuleType

from engine_plugin_sdk import DetectResult

DEVICE_NODE_PATTERN = "/dev/davinci[0-9]*"
INSTALL_HINT = (
    "install torch-npu matching your torch (pip install 'engine-plugin-ascend[npu]'); "
    "it needs Huawei's CANN toolkit on the host"
)


def torch_npu_installed() -> bool:
    """Whether a ``torch_npu`` package is importable, without importing it."""
    return importlib.util.find_spec("torch_npu") is not None


def npu_device_nodes() -> list[str]:
    """The Ascend driver's device nodes present on this host."""
    return sorted(glob.glob(DEVICE_NODE_PATTERN))


def import_torch_npu() -> ModuleType:
    """Import torch_npu (it loads CANN's libraries; it does not open a device)."""
    return importlib.import_module("torch_npu")


def npu_device_count(torch_npu: ModuleType) -> int:
    """NPUs torch_npu can see (honours ``ASCEND_RT_VISIBLE_DEVICES``), without creating a context."""
    return int(torch_npu.npu.device_count())


def detect_npu() -> DetectResult:
    """Whether an NPU is usable through torch_npu; when not, the reason in one sentence."""
    if not torch_npu_installed():
        return DetectResult(False, f"torch_npu is not installed; {INSTALL_HINT}")
    if not npu_device_nodes():
        return DetectResult(
            False, f"no Ascend device nodes ({DEVICE_NODE_PATTERN}); is the Ascend NPU driver installed?"
        )
    try:
        torch_npu = import_torch_npu()
    except (ImportError, OSError) as exc:  # typically CANN's shared libraries are not on the loader path
        first_line = (str(exc).splitlines() or [""])[0]
        return DetectResult(
            False,
            f"importing torch_npu failed ({type(exc).__name__}: {first_line}); "
            "source CANN's set_env.sh and check that torch_npu matches the installed torch",
        )
    try:
        count = npu_device_count(torch_npu)
    except RuntimeError as exc:
        return DetectResult(False, f"torch_npu could not count NPUs: {(str(exc).splitlines() or [''])[0]}")
    if count < 1:
        return DetectResult(False, "torch_npu sees no NPU (check ASCEND_RT_VISIBLE_DEVICES and the driver)")
    return DetectResult(True)
