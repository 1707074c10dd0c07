"""Copies from the device to the host that do not wait for the device's queue."""

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
