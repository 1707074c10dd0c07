"""The KV-cache layout and the geometry torch_npu's attention kernels accept.

Per layer the cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: index 0 holds keys,
1 values. ``cache[0]`` is then exactly the ``(num_blocks, block_size, kv_heads, head_dim)`` tensor
``_npu_reshape_and_cache`` writes, and a free view of it is the ``(num_blocks, block_size,
kv_heads * head_dim)`` tensor ``npu_fused_infer_attention_score`` reads with page attention and a BSND
query, so no layer ever copies or reformats its cache.

Block size: the fused attention's page-attention mode needs a multiple of 128 in [128, 512] for
prefill (S > 1); 128 is the one size claimed (the smallest, so the least padding per sequence).
Head sizes: fp16/bf16 attention needs a 16-aligned head_dim of at most 512; the claimed sizes are the
common ones within that rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the platform module imports these constants while plugins are detected: no torch then
    import torch

SUPPORTED_DTYPES = ("bfloat16", "float16")
#: what ``--dtype auto`` means here: bf16 keeps fp32's range, which bf16-trained checkpoints rely on
PREFERRED_DTYPE = "bfloat16"
SUPPORTED_BLOCK_SIZES = (128,)
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
#: the fused attention refuses more query heads per KV head than this
MAX_HEAD_RATIO = 64
#: the side of the optimised causal mask that sparse_mode 3 (rightDownCausal) takes
CAUSAL_MASK_SIDE = 2048


def check_geometry(
    block_size: int, head_dim: int, num_heads: int | None = None, num_kv_heads: int | None = None
) -> None:
    """Raise ValueError, in one line, for a geometry the kernels do not run.

    Args:
        block_size: tokens per KV block.
        head_dim: size of one head.
        num_heads: query heads, when known.
        num_kv_heads: key/value heads, when known.
    """
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block size {block_size} is not supported on npu (supported: {list(SUPPORTED_BLOCK_SIZES)})"
        )
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head size {head_dim} is not supported on npu (supported: {list(SUPPORTED_HEAD_SIZES)})"
        )
    if num_heads is not None and num_kv_heads is not None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if num_heads // num_kv_heads > MAX_HEAD_RATIO:
            raise ValueError(
                f"{num_heads // num_kv_heads} query heads per KV head; the NPU attention allows {MAX_HEAD_RATIO}"
            )


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cache shape (keys and values together); validates the geometry first."""
    if num_blocks < 1 or num_kv_heads < 1:
        raise ValueError(f"num_blocks and num_kv_heads must be positive, got {num_blocks} and {num_kv_heads}")
    check_geometry(block_size, head_dim)
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def split_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches ``(num_blocks, block_size, kv_heads, head_dim)`` of one layer (views).

    Raises:
        ValueError: for a tensor not laid out by :func:`kv_cache_shape`.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    return kv_cache[0], kv_cache[1]


def as_page_attention_kv(cache: torch.Tensor) -> torch.Tensor:
    """A ``(num_blocks, block_size, kv_heads, head_dim)`` cache as the ``(blocknum, blocksize, H)`` view."""
    num_blocks, block_size, heads, dim = cache.shape
    return cache.view(num_blocks, block_size, heads * dim)


def causal_mask(device: torch.device) -> torch.Tensor:
    """The optimised rightDownCausal mask: bool ``[2048, 2048]``, True (masked) strictly above the diagonal."""
    import torch

    side = CAUSAL_MASK_SIDE
    return torch.ones(side, side, dtype=torch.bool, device=device).triu(diagonal=1)
