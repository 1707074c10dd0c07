"""Checkpoint tensors read on demand, a window at a time: how a tensor-parallel rank reads only its own
rows or columns of each projection from safetensors files instead of every rank reading the whole model.

A :class:`LazyTensor` knows its file, name, shape and dtype; slicing its first two dimensions gives a
narrower window without reading anything, and :func:`materialize` reads just the window (safetensors
reads the bytes of a slice only). Everything else in the loader works on ordinary tensors: whatever takes
a checkpoint tensor and needs all of it calls :func:`materialize` first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class LazyTensor:
    """A window of one tensor in a safetensors file, not read yet.

    Attributes:
        file: the safetensors file.
        name: the tensor's name in it.
        full_shape: the stored tensor's shape.
        dtype: its torch dtype.
        window: ``(start, stop)`` along each of the first ``len(window)`` dimensions (the rest whole).
    """

    file: str
    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    window: tuple[tuple[int, int], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        spans = [stop - start for start, stop in self.window]
        return (*spans, *self.full_shape[len(spans) :])

    @property
    def ndim(self) -> int:
        return len(self.full_shape)

    def dim(self) -> int:
        return len(self.full_shape)

    def _bounds(self) -> list[tuple[int, int]]:
        return [*self.window, *((0, n) for n in self.full_shape[len(self.window) :])]

    def __getitem__(self, index: Any) -> LazyTensor:
        """A narrower window: unit-step slices of the leading dimensions (``t[a:b]``, ``t[:, c:d]``).

        Raises:
            TypeError: for any other index (materialize first).
        """
        parts = index if isinstance(index, tuple) else (index,)
        if len(parts) > self.ndim or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
            raise TypeError(f"a lazy checkpoint tensor takes unit-step slices only, got {index!r}")
        bounds = self._bounds()
        for axis, part in enumerate(parts):
            start, stop, _ = part.indices(bounds[axis][1] - bounds[axis][0])
            offset = bounds[axis][0]
            bounds[axis] = (offset + start, offset + max(start, stop))
        used = max(len(self.window), len(parts))
        return replace(self, window=tuple(bounds[:used]))

    def split(self, sizes: list[int], dim: int = 0) -> list[LazyTensor]:
        """Consecutive windows of ``sizes`` along ``dim`` (as ``torch.split`` with a list)."""
        pieces, start = [], 0
        for size in sizes:
            index = (slice(None),) * dim + (slice(start, start + size),)
            pieces.append(self[index])
            start += size
        return pieces


def read_window(lazy: LazyTensor) -> torch.Tensor:
    """Read a window's bytes from its file (the one place a lazy tensor touches the disk)."""
    from safetensors import safe_open

    with safe_open(lazy.file, framework="pt", device="cpu") as f:
        stored = f.get_slice(lazy.name)
        index = tuple(slice(start, stop) for start, stop in lazy.window)
        return stored[index] if index else stored[:]


def materialize(tensor: Any) -> Any:
    """A lazy tensor's window as a torch tensor; anything else unchanged."""
    return read_window(tensor) if isinstance(tensor, LazyTensor) else tensor


def lazy_safetensors(file: str) -> list[tuple[str, LazyTensor]]:
    """Every tensor of a safetensors file, by name, none of them read."""
    from safetensors import safe_open

    dtypes = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }  # fmt: skip
    out = []
    with safe_open(file, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            stored = f.get_slice(name)
            out.append((name, LazyTensor(file, name, tuple(stored.get_shape()), dtypes[stored.get_dtype()])))
    return out
