"""Every call into torch_npu the plugin makes, and nothing else: the part that runs only on an NPU.

**Unverified here**: this module was written against torch_npu's documented APIs on a machine without
an NPU or CANN; no line of it has run. The CPU test suite swaps it for
:mod:`engine_plugin_ascend.reference_kernels` (same functions, same argument layouts) to check all
the glue around it. A team with Ascend hardware verifies it with ``engine conformance --device npu``.

torch_npu is imported inside each function, never at module import, so that importing the plugin
(and detecting the device) stays cheap.

APIs relied on (Ascend Extension for PyTorch docs, op-plugin ``docs/context/*.md``):

- ``torch_npu.npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths,
  actual_seq_lengths_kv, block_table, num_heads, scale, input_layout, num_key_value_heads,
  sparse_mode, block_size, ...) -> (attention_out, softmax_lse)``: one op for the full (S > 1,
  PromptFlashAttention) and incremental (S == 1, IncreFlashAttention) branches. Used with query layout
  ``BSND``, page attention (``block_table`` int32 ``[B, max_blocks]``, key/value as the cache itself
  shaped ``(num_blocks, block_size, kv_heads * head_dim)``, the only cache layout documented for BSH /
  BSND queries), ``actual_seq_lengths_kv`` required with page attention, ``block_size`` a multiple of
  128 in [128, 512] when S > 1, fp16/bf16 only, D 16-aligned, heads ratio at most 64, and
  ``sparse_mode=3`` (rightDownCausal: the query block ends at the key block's end) with the optimised
  2048 x 2048 lower-triangular ``atten_mask`` (True = masked). Older releases name ``scale``
  ``scale_value``; this code needs a release whose docs use ``scale``.
- ``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``: writes
  ``[T, kv_heads, head_dim]`` keys/values into ``(num_blocks, block_size, kv_heads, head_dim)`` caches
  at int32 slots; op-plugin's own test reference skips negative slots.
- ``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`` (gamma in x's dtype);
  ``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)``.
- ``torch_npu.npu_rotary_mul(x, r1, r2)``: ``x * r1 + rotate_half(x) * r2`` ("half" mode) on a 4-D x
  (BSND here: ``[1, T, N, D]``) with r1/r2 broadcast as ``[1, T, 1, D]``.
- ``torch_npu.npu_swiglu(x, dim=-1)``: ``silu(A) * B`` for the halves A, B of ``x`` along ``dim``.
- ``torch_npu.npu.NPUGraph`` / ``torch_npu.npu.graph`` (docs/zh/developer_notes/npugraph.md): capture
  on a stream, replay reuses the captured memory, new inputs must be ``copy_``-ed into it.
- ``torch_npu.npu.mem_get_info``, ``synchronize``, ``manual_seed_all``; the ``hccl`` backend of
  ``torch.distributed``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

DEVICE_TYPE = "npu"
COMMUNICATOR_BACKEND = "hccl"


def _torch_npu() -> ModuleType:
    # registers the "npu" device type with torch on first import; later calls are a sys.modules lookup
    return importlib.import_module("torch_npu")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Store ``key``/``value`` rows at ``slot_indices`` of the paged caches, in place."""
    _torch_npu()._npu_reshape_and_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slot_indices
    )


def fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    block_table: torch.Tensor,
    actual_seq_lengths: Sequence[int] | None,
    actual_seq_lengths_kv: Sequence[int],
    atten_mask: torch.Tensor | None,
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    input_layout: str,
    sparse_mode: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention of a padded query batch; returns ``(attention_out, softmax_lse)``."""
    return _torch_npu().npu_fused_infer_attention_score(
        query,
        key,
        value,
        atten_mask=atten_mask,
        actual_seq_lengths=None if actual_seq_lengths is None else list(actual_seq_lengths),
        actual_seq_lengths_kv=list(actual_seq_lengths_kv),
        block_table=block_table,
        num_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        scale=scale,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
    )


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * rsqrt(mean(x^2) + eps) * gamma, rstd)``."""
    return _torch_npu().npu_rms_norm(x, gamma, epsilon=epsilon)


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rms_norm(x1 + x2), rstd, x1 + x2)``."""
    return _torch_npu().npu_add_rms_norm(x1, x2, gamma, epsilon)


def rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``x * r1 + rotate_half(x) * r2`` on 4-D tensors."""
    return _torch_npu().npu_rotary_mul(x, r1, r2)


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(A) * B`` for the two halves of ``x`` along ``dim``."""
    return _torch_npu().npu_swiglu(x, dim=dim)


def capture_graph(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
    """Record ``fn(*inputs)`` into an NPU graph; returns ``(graph, static_output)``.

    One eager run on a side stream first, so that one-time work (workspace allocation, kernel tiling
    caches) happens outside the capture.
    """
    npu = _torch_npu().npu
    side = npu.Stream()
    side.wait_stream(npu.current_stream())
    with npu.stream(side):
        fn(*inputs)
    npu.current_stream().wait_stream(side)
    graph = npu.NPUGraph()
    with npu.graph(graph):
        output = fn(*inputs)
    return graph, output


def replay_graph(graph: Any) -> None:
    """Replay a captured graph; it reads the captured input memory and writes the captured output."""
    graph.replay()


def torch_device(index: int | None = None) -> torch.device:
    """The torch device tensors go to (importing torch_npu registers the ``npu`` type)."""
    _torch_npu()
    return torch.device(DEVICE_TYPE) if index is None else torch.device(DEVICE_TYPE, index)


def mem_get_info() -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the current NPU."""
    free, total = _torch_npu().npu.mem_get_info()
    return int(free), int(total)


def synchronize() -> None:
    """Wait for all queued NPU work."""
    _torch_npu().npu.synchronize()


def manual_seed(seed: int) -> None:
    """Seed torch's host generator and every NPU generator."""
    torch.manual_seed(seed)
    _torch_npu().npu.manual_seed_all(seed)
