"""Copies between the device and the host that do not wait for the device's queue."""

from __future__ import annotations

from typing import Any

import torch


def copy_to_host_async(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A non-blocking copy to (pinned) host memory and an event marking its end; a device whose torch
    backend has no generic events gets a blocking copy instead (correct, just not overlapped).

    Returns:
        The host tensor (not to be read before the event's ``synchronize()`` returned) and the event,
        None when the copy has already ended (a CPU tensor is returned as it is).
    """
    if tensor.device.type == "cpu":
        return tensor, None
    try:
        ready = torch.Event(device=tensor.device)
    except (RuntimeError, ValueError, TypeError):
        return tensor.cpu(), None
    host = tensor.to("cpu", non_blocking=True)
    ready.record()
    return host, ready


def copy_to_device_async(
    values: list[int] | list[float] | list[bool] | list[list[int]], device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Host numbers as a ``dtype`` tensor on ``device`` (see :func:`tensor_to_device_async`)."""
    return tensor_to_device_async(torch.tensor(values, dtype=dtype), device)


def tensor_to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, copied behind the work already queued there: from pageable memory a
    copy waits until the device has run that work (a step prepared while the one before still runs would
    stall for it), from pinned memory it is queued."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
