"""CPU stand-ins for :mod:`engine_plugin_ascend.npu_kernels`: same functions, same argument layouts.

**For testing only** (selected by ``ENGINE_ASCEND_KERNELS=reference``, see
:mod:`engine_plugin_ascend.kernel_switch`). Each function first checks its arguments against the
constraints torch_npu documents for the real op (dtypes, ranks, layouts, int32 indices, block-size and
mask rules) and raises ``ValueError`` naming the broken rule, then computes the op's documented result
with the float64/float32 reference ops of :mod:`engine_plugin_sdk.reference_ops`. So a conformance run
on these checks that the plugin's glue calls the kernels the way their documentation asks and
interprets their outputs correctly; it says nothing about the NPU kernels themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_plugin_sdk.reference_ops import ref_attention

DEVICE_TYPE = "cpu"
COMMUNICATOR_BACKEND = "gloo"
#: dtypes torch_npu's fused attention takes for query, key and value
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
#: the side of the optimised causal mask sparse modes 2-4 require
OPTIMISED_MASK_SIDE = 2048
MAX_HEAD_RATIO = 64


def _require(ok: bool, op: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {rule}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Write each row of ``key``/``value`` to its slot; negative slots are skipped."""
    op = "_npu_reshape_and_cache"
    _require(key.dim() == 3 and key.shape == value.shape, op, "key and value must be [T, kv_heads, head_dim]")
    _require(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, op,
             "caches must be (num_blocks, block_size, kv_heads, head_dim)")  # fmt: skip
    _require(tuple(key_cache.shape[2:]) == tuple(key.shape[1:]), op, "cache heads/head_dim differ from key's")
    _require(key.dtype == key_cache.dtype == value.dtype == value_cache.dtype, op,
             f"key/value dtype {key.dtype} must equal the cache dtype {key_cache.dtype}")  # fmt: skip
    _require(key.is_contiguous() and value.is_contiguous(), op, "key and value must be contiguous")
    _require(
        slot_indices.dtype == torch.int32 and slot_indices.dim() == 1, op, "slot_indices must be int32 [T]"
    )
    _require(slot_indices.numel() == key.shape[0], op, "one slot per key row")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    keep = slot_indices >= 0
    slots = slot_indices[keep].long()
    if slots.numel() == 0:
        return
    _require(int(slots.max()) < num_slots, op, f"slot {int(slots.max())} is beyond the cache's {num_slots}")
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slots, key[keep])
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slots, value[keep])


def _expected_causal_mask(device: torch.device) -> torch.Tensor:
    side = OPTIMISED_MASK_SIDE
    return torch.ones(side, side, dtype=torch.bool, device=device).triu(diagonal=1)


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
    """Page-attention with a ``BSND`` query; padding rows (beyond a batch's length) come back as zeros."""
    op = "npu_fused_infer_attention_score"
    if input_layout != "BSND":
        raise NotImplementedError(f"{op}: the reference substitute implements input_layout BSND only")
    _require(query.dim() == 4, op, "a BSND query is [B, S, N, D]")
    batch, q_s, heads, dim = query.shape
    _require(heads == num_heads, op, f"num_heads {num_heads} differs from the query's N {heads}")
    kv_heads = num_key_value_heads or num_heads
    _require(num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_HEAD_RATIO, op,
             "num_heads must be a multiple of num_key_value_heads, at most 64 times it")  # fmt: skip
    _require(query.dtype in ATTENTION_DTYPES, op, f"query dtype {query.dtype} is not float16/bfloat16")
    _require(dim % 16 == 0 and dim <= 512, op, f"head_dim {dim} must be 16-aligned and at most 512")
    _require(query.is_contiguous(), op, "query must be contiguous")
    # page attention: key/value are the caches themselves, (num_blocks, block_size, kv_heads * head_dim)
    _require(key.dim() == 3 and key.shape == value.shape, op,
             "with page attention and a BSND query, key/value must be (blocknum, blocksize, H)")  # fmt: skip
    _require(key.shape[1] == block_size and key.shape[2] == kv_heads * dim, op,
             f"key {tuple(key.shape)} does not match block_size {block_size} and H {kv_heads * dim}")  # fmt: skip
    _require(key.dtype == value.dtype == query.dtype, op, "key/value dtype must equal the query's")
    if q_s > 1:
        _require(block_size % 128 == 0 and 128 <= block_size <= 512, op,
                 f"block_size {block_size} must be a multiple of 128 in [128, 512]")  # fmt: skip
    else:
        _require(block_size % 16 == 0 and block_size > 0, op, f"block_size {block_size} must be 16-aligned")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table must be int32 2-D")
    _require(block_table.shape[0] == batch, op, "block_table needs one row per batch")
    kv_lens = [int(n) for n in actual_seq_lengths_kv]
    _require(
        len(kv_lens) >= batch, op, "actual_seq_lengths_kv is required with page attention, one per batch"
    )
    q_lens = [q_s] * batch if actual_seq_lengths is None else [int(n) for n in actual_seq_lengths]
    _require(len(q_lens) >= batch and all(0 < n <= q_s for n in q_lens[:batch]), op,
             "actual_seq_lengths needs one length in [1, S] per batch")  # fmt: skip
    max_blocks = block_table.shape[1]
    _require(all(n <= max_blocks * block_size for n in kv_lens[:batch]), op,
             "block_table has fewer columns than the longest actual_seq_lengths_kv needs")  # fmt: skip
    causal = False
    if q_s > 1:
        _require(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode} is not implemented by the substitute")
        if sparse_mode == 3:
            _require(atten_mask is not None and atten_mask.dtype == torch.bool
                     and tuple(atten_mask.shape) == (OPTIMISED_MASK_SIDE, OPTIMISED_MASK_SIDE), op,
                     "sparse_mode 3 needs the optimised 2048 x 2048 bool atten_mask")  # fmt: skip
            assert atten_mask is not None
            _require(bool(torch.equal(atten_mask, _expected_causal_mask(atten_mask.device))), op,
                     "the optimised causal mask must be True strictly above the diagonal")  # fmt: skip
            _require(all(q <= k for q, k in zip(q_lens, kv_lens, strict=False)), op,
                     "rightDownCausal needs actual_seq_lengths <= actual_seq_lengths_kv per batch")  # fmt: skip
            causal = True
        else:
            _require(atten_mask is None, op, "the substitute implements sparse_mode 0 without a mask only")
    else:
        _require(atten_mask is None, op, "the substitute implements the incremental branch without a mask")
    keys = key.view(key.shape[0], block_size, kv_heads, dim)
    values = value.view(value.shape[0], block_size, kv_heads, dim)
    out = torch.zeros_like(query)
    for b in range(batch):
        q_len, kv_len = q_lens[b], kv_lens[b]
        needed = -(-kv_len // block_size)
        ids = block_table[b, :needed].long()
        _require(
            bool(((ids >= 0) & (ids < key.shape[0])).all()), op, f"batch {b} has a block id out of range"
        )
        k = keys.index_select(0, ids).flatten(0, 1)[:kv_len]
        v = values.index_select(0, ids).flatten(0, 1)[:kv_len]
        rows = ref_attention(query[b, :q_len], [k], [v], [q_len], scale, causal=causal)
        out[b, :q_len] = rows.to(query.dtype)
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` with y in x's dtype and rstd float32."""
    op = "npu_rms_norm"
    _require(gamma.dtype == x.dtype, op, f"gamma dtype {gamma.dtype} must equal x's {x.dtype}")
    _require(
        tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]), op, "gamma must match x's last dims"
    )
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rms_norm(x1 + x2), rstd, x1 + x2)``; the sum is returned in the inputs' dtype."""
    _require(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm", "x1 and x2 must match")
    summed = x1.float() + x2.float()
    y, rstd = rms_norm(summed, gamma.float(), epsilon)
    return y.to(x1.dtype), rstd, summed.to(x1.dtype)


def rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``x * r1 + rotate_half(x) * r2`` ("half" mode), computed in float32."""
    op = "npu_rotary_mul"
    _require(x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, op, "x, r1 and r2 must be 4-D")
    _require(
        r1.shape == r2.shape and r1.dtype == r2.dtype == x.dtype, op, "r1/r2 must share x's dtype and match"
    )
    _require(
        x.shape[-1] % 2 == 0 and r1.shape[-1] == x.shape[-1], op, "D must be even and equal in x, r1, r2"
    )
    _require(
        all(r in (1, s) for r, s in zip(r1.shape, x.shape, strict=True)), op, "r1/r2 must broadcast to x"
    )
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (xf * r1.float() + rotated * r2.float()).to(x.dtype)


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(A) * B`` for the halves of ``x`` along ``dim``."""
    op = "npu_swiglu"
    _require(x.is_contiguous(), op, "input must be contiguous")
    _require(x.shape[dim] % 2 == 0, op, f"dimension {dim} of size {x.shape[dim]} is not even")
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


@dataclass(slots=True)
class RecordedStep:
    """What an NPU graph keeps: the step, the memory it reads, and the memory it writes."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    output: Any


def capture_graph(fn: Callable[..., Any], inputs: Sequence[Any]) -> tuple[RecordedStep, Any]:
    """Emulate capture: run once and pin the output tensor(s), as a graph pins its output memory."""
    static = tuple(inputs)
    output = fn(*static)
    return RecordedStep(fn, static, output), output


def replay_graph(graph: RecordedStep) -> None:
    """Emulate replay: rerun on the captured input tensors, write into the captured output tensors."""
    result = graph.fn(*graph.inputs)
    outputs = graph.output if isinstance(graph.output, (tuple, list)) else (graph.output,)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for target, fresh in zip(outputs, results, strict=True):
        target.copy_(fresh)


def torch_device(index: int | None = None) -> torch.device:
    """The host CPU: the substitute runs on CPU tensors."""
    return torch.device(DEVICE_TYPE)


def mem_get_info() -> tuple[int, int]:
    """Host memory ``(available, total)`` from /proc/meminfo."""
    from engine_plugin_sdk.reference_platform import host_memory_bytes

    total = host_memory_bytes("MemTotal") or 0
    free = host_memory_bytes("MemAvailable") or 0
    return free, total


def synchronize() -> None:
    """Nothing is queued on the CPU."""
    return None


def manual_seed(seed: int) -> None:
    """Seed torch's host generator."""
    torch.manual_seed(seed)
