"""Runs the Triton kernels in Triton's CPU interpreter when no NVIDIA GPU is present.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so it is set here, before any test imports
the kernel modules. GPU-only tests skip themselves with a reason.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")

@pytest.fixture
def kernel_dtypes() -> list[torch.dtype]:
    """bf16 only on a GPU: ``tl.dot`` on bf16 is wrong in the interpreter."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
