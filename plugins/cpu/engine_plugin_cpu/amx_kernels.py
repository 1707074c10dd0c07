"""The C kernels that run on AMX tiles (``csrc/encoder_attention.c``, ``csrc/dense_amx.c``): the encoder's
attention and dense bf16 products with their bias and activation, and the weight layout those read.

:class:`AmxKernels` is a part of :class:`~engine_plugin_cpu.native_kernels.NativeKernels`, which owns the
library, the thread pool and the OpenMP team these calls run on.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

#: output columns a packed weight's tile pair covers (two 16-column B tiles)
PAIR_COLUMNS = 32
#: inner-dimension elements one B tile covers
TILE_DEPTH = 32
#: the activations ``dense_amx_bf16`` applies to the product (its ``epilogue`` argument)
ACTIVATIONS = {"none": 0, "gelu": 1}


@dataclass(slots=True)
class AmxWeight:
    """A bf16 ``[out, in]`` weight packed as the AMX product's B tiles.

    Attributes:
        tiles: bf16 ``[ceil(out / 32), in / 32, 2, 16, 32]``: for each pair of 16-column tiles and each
            32-deep chunk of the inner dimension, two tiles whose row ``r`` interleaves inner elements
            ``2r`` and ``2r + 1`` of 16 output columns (rows past ``out`` are zero).
        out_features: rows of the logical weight.
        in_features: its columns, a multiple of 32.
    """

    tiles: torch.Tensor
    out_features: int
    in_features: int


def amx_packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_amx_weight` takes ``weight``: a 2-D bf16 matrix whose columns come in 32s."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % TILE_DEPTH == 0


def pack_amx_weight(weight: torch.Tensor) -> AmxWeight:
    """``weight`` (bf16 ``[out, in]``, see :func:`amx_packable`) in the tiles' layout."""
    out, width = weight.shape
    pad = -out % PAIR_COLUMNS
    if pad:
        weight = torch.cat([weight, weight.new_zeros((pad, width))])
    # [pair, tile, column, chunk, row, element] -> [pair, chunk, tile, row, column, element]
    tiles = weight.reshape(-1, 2, 16, width // TILE_DEPTH, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return AmxWeight(tiles.view(*tiles.shape[:4], 32), out, width)


def unpack_amx_weight(weight: AmxWeight) -> torch.Tensor:
    """The bf16 ``[out, in]`` matrix back from its tiles (exact)."""
    plain = weight.tiles.view(*weight.tiles.shape[:4], 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, weight.in_features)
    return plain[: weight.out_features].contiguous()


class AmxKernels:
    """The AMX calls of :class:`~engine_plugin_cpu.native_kernels.NativeKernels`."""

    lib: ctypes.CDLL
    threads: int
    #: the AMX tile kernels may run (the CPU has AMX-BF16 and the OS granted the tile state)
    amx: bool
    _pool: Any
    _team_arg: Any

    def encoder_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        starts: torch.Tensor,
        max_len: int,
        scale: float,
        out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """Bidirectional attention of whole prompts on AMX tiles; bf16 ``[tokens, heads, dim]``.

        Args:
            query: ``[tokens, heads, dim]`` bf16; key / value ``[tokens, kv_heads, dim]``. Rows may be
                strided views (a fused q/k/v output) but each token's heads must be contiguous.
            starts: int64 ``[prompts + 1]`` token offsets of the prompts (a prompt attends to its own rows).
            max_len: the longest prompt's tokens.
            scale: the scores' scale.
            out: where to write (rows may be strided), or None for a new tensor.
            threads: threads to split the (prompt, kv head) pairs over; None: the pool's size.

        Raises:
            ValueError: without AMX, a head dimension that is not a multiple of 32, or a prompt longer
                than ``max_len``.
            MemoryError: if a thread cannot allocate its scratch.
        """
        tokens, heads, dim = query.shape
        if not self.amx or dim % 32:
            raise ValueError(f"the AMX encoder attention needs AMX and a head dimension in 32s (got {dim})")
        if out is None:
            out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16)
        failed = self.lib.encoder_attention_bf16(
            self._pool, self._team_arg, query.data_ptr(), key.data_ptr(),
            value.data_ptr(), query.stride(0), key.stride(0), value.stride(0), out.data_ptr(), out.stride(0),
            starts.data_ptr(), starts.numel() - 1, max_len,
            heads, key.shape[1], dim, scale, threads or self.threads,
        )  # fmt: skip
        if failed == -2:
            raise ValueError(f"a prompt is longer than max_len={max_len} given to the encoder attention")
        if failed:
            raise MemoryError("the CPU encoder attention could not allocate its scratch")
        return out

    def dense(
        self, x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None = None, activation: str = "none"
    ) -> torch.Tensor:
        """``act(x @ W^T + bias)`` on AMX tiles, bf16 ``[..., out]``.

        Args:
            x: bf16 ``[..., in]``; its rows may be strided (a 2-D view) if each row is contiguous.
            weight: a :func:`pack_amx_weight` weight.
            bias: ``[out]`` or None.
            activation: ``"none"`` or ``"gelu"`` (in its tanh form: at most 4.7e-4 from erf's, a thirtieth
                of a bf16 rounding at that size).

        Raises:
            ValueError: without AMX, or for operands the kernel does not take.
            MemoryError: if a thread cannot allocate its scratch.
        """
        if not self.amx:
            raise ValueError("the AMX dense product needs AMX tiles, which this CPU or OS does not grant")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
        out_f, in_f = weight.out_features, weight.in_features
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.bfloat16 or flat.shape[1] != in_f or flat.stride(1) != 1:
            raise ValueError(f"the AMX dense product takes bf16 rows of {in_f} contiguous values, got {tuple(x.shape)} {x.dtype}")
        out = torch.empty((flat.shape[0], out_f), dtype=torch.bfloat16)
        b = None if bias is None else bias.to(torch.bfloat16).contiguous()
        failed = self.lib.dense_amx_bf16(
            self._pool, self._team_arg, flat.data_ptr(), flat.stride(0), flat.shape[0], in_f, weight.tiles.data_ptr(),
            out_f, 0 if b is None else b.data_ptr(), ACTIVATIONS[activation], out.data_ptr(), out.stride(0), self.threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("the AMX dense product could not allocate its scratch")
        return out.reshape(*x.shape[:-1], out_f)
