"""Launch parameters for the shared Triton kernels, chosen per target by the caller.

The kernels never ask which GPU they run on: a plugin (NVIDIA, AMD ROCm, ...) builds a
:class:`KernelTuning` for its device and passes it to every launcher. That keeps the kernel modules free
of vendor APIs, so another backend reuses them by importing this package and supplying its own table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Tile shapes and warps of one attention kernel.

    Attributes:
        block_m: query rows per program (prefill).
        block_n: keys per inner-loop iteration.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class KernelTuning:
    """Everything a launcher needs to pick launch parameters on one target.

    Attributes:
        num_compute_units: multiprocessors (NVIDIA SMs, AMD CUs); sizes the decode context split.
        prefill_small_head: tiles for prefill attention with head size <= 128.
        prefill_large_head: tiles for prefill attention with head size > 128.
        decode_block_n: keys per iteration of the decode kernel.
        decode_num_warps: warps per decode program.
        decode_num_stages: pipelining depth of the decode key loop.
        decode_fp8: ``(block_n, num_warps, num_stages)`` of the decode kernel over an FP8 cache, whose
            tiles hold half the bytes; None: the same as over any other cache.
        decode_large_head: ``(block_n, num_warps, num_stages)`` of the decode kernel over a bf16 / fp16
            cache at head sizes over 128, whose key and value tiles are twice as wide; None: the same as
            at smaller heads.
        max_decode_splits: most programs one sequence's context is split across (flash-decoding).
        min_keys_per_split: a split never gets fewer keys than this (below it the merge costs more).
        decode_min_split_keys: where the split count was fixed without the context's length (a graph), no split
            takes fewer keys than this (rounded up to whole ``decode_block_n`` tiles; 0: one tile), the splits past
            a short context's end holding none: a 384-token context over 32 splits is read by six programs of one
            tile each, or by three of two tiles at 128 (and merged from three partials). Measured slower on an H100
            (2026-12-07, Qwen3-30B-A3B batch-1 decode in graphs): 128 keys 325.5 against 332.3 tok/s after a
            128-token prompt, 316.7 against 317.7 after 2,048. Off.
        elementwise_num_warps: warps for norm / rotary / activation kernels.
        use_pdl: launch every kernel with programmatic dependent launch (CUDA compute capability 9.0+;
            see :mod:`.pdl`), so that each starts while the one before it drains.
        decode_merge_last: a split decode's last program to finish merges the splits (arrival counts
            kept by the attention backend) instead of a merge kernel: one launch fewer per layer. Off: on
            an H200 (2026-12-03, Qwen3-30B-A3B shape, batch-1 decode in graphs) it measured 343.5 tok/s
            against 376.6 with the merge kernel, the last program's serial merge costing more than a launch.
        decode_early_kv: under PDL, a decode program that writes the step's key and value itself reads its
            context length, block table and first cached key and value tile before it waits for the kernel
            that wrote the query (see ``paged_decode_kernel``).
        decode_paired_fp8: ``(block_n, num_warps, num_stages)`` of the decode kernel when each program takes
            two KV heads (:mod:`.decode_attention_kernels`), which it does over an FP8 cache where the batch
            fills the device by itself (:meth:`decode_kv_heads`); None: one KV head a program.
        decode_paired_any_cache: pair KV heads over every cache dtype, not only FP8 (tests, tuning).
    """

    num_compute_units: int = 132
    prefill_small_head: AttentionTiles = AttentionTiles(64, 64, 4, 2)
    prefill_large_head: AttentionTiles = AttentionTiles(32, 32, 4, 2)
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    decode_fp8: tuple[int, int, int] | None = None
    decode_large_head: tuple[int, int, int] | None = None
    max_decode_splits: int = 32
    min_keys_per_split: int = 256
    decode_min_split_keys: int = 0
    elementwise_num_warps: int = 4
    use_pdl: bool = False
    decode_merge_last: bool = False
    decode_early_kv: bool = True
    decode_paired_fp8: tuple[int, int, int] | None = None
    decode_paired_any_cache: bool = False

    def prefill_tiles(self, head_dim: int) -> AttentionTiles:
        """The prefill tiles for a head size."""
        return self.prefill_small_head if head_dim <= 128 else self.prefill_large_head

    def decode_kv_heads(self, fp8_cache: bool, num_seqs: int, num_kv_heads: int, group: int, head_dim: int = 128) -> int:
        """KV heads a decode program takes: two where the table has paired tiles, over an FP8 cache (or any with
        ``decode_paired_any_cache``), the two heads' query rows fit the 16 the tensor cores take at least, the
        heads are at most 128 wide (the paired tiles are sized for them), and half as many programs still fill the
        device twice without splitting a context; else one.

        Args:
            fp8_cache: the cache holds FP8 values.
            num_seqs: sequences in the batch (a graph's bucket).
            num_kv_heads: KV heads of the layer (this rank's).
            group: query heads per KV head.
            head_dim: the head size.

        Returns:
            1 or 2.
        """
        if self.decode_paired_fp8 is None or not (fp8_cache or self.decode_paired_any_cache):
            return 1
        if num_kv_heads % 2 or 2 * group > 16 or head_dim > 128:
            return 1
        return 2 if num_seqs * (num_kv_heads // 2) >= 2 * self.num_compute_units else 1

    def decode_tiles(self, fp8_cache: bool, head_dim: int = 128, kv_heads: int = 1) -> dict[str, int]:
        """The decode kernel's ``BLOCK_N``, ``num_warps`` and ``num_stages`` launch arguments for programs of
        ``kv_heads`` KV heads (:meth:`decode_kv_heads`)."""
        if kv_heads == 2 and self.decode_paired_fp8:
            block_n, warps, stages = self.decode_paired_fp8
        elif fp8_cache and self.decode_fp8:
            block_n, warps, stages = self.decode_fp8
        elif head_dim > 128 and self.decode_large_head:
            block_n, warps, stages = self.decode_large_head
        else:
            block_n, warps, stages = self.decode_block_n, self.decode_num_warps, self.decode_num_stages
        return {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_seq_len: int | None) -> int:
        """How many programs share one sequence's context in the decode kernel.

        Enough programs to fill the device about twice, but no split shorter than
        ``min_keys_per_split`` keys when the longest context is known. Under graph capture the
        context length is not fixed, so the caller passes None and the count depends only on the batch.

        Args:
            num_seqs: sequences in the batch.
            num_kv_heads: programs per sequence before splitting.
            max_seq_len: the longest context, or None when it may change between replays.

        Returns:
            A power of two in ``[1, max_decode_splits]``.
        """
        programs = max(1, num_seqs * num_kv_heads)
        want = max(1, (2 * self.num_compute_units + programs - 1) // programs)
        if max_seq_len is not None:
            want = min(want, max(1, max_seq_len // self.min_keys_per_split))
        splits = 1
        while splits * 2 <= min(want, self.max_decode_splits):
            splits *= 2
        return splits


#: what the CPU interpreter runs with: small tiles keep the interpreted programs quick, but each program
#: costs the interpreter about the same whatever its tile, so the prefill tiles are not the smallest: 32
#: rows and keys (against 16) halved the non-causal conformance rows, whose prompts of 33 and 150 tokens
#: still cross tiles
INTERPRETER_TUNING = KernelTuning(
    num_compute_units=4,
    prefill_small_head=AttentionTiles(32, 32, 4, 1),
    prefill_large_head=AttentionTiles(16, 16, 4, 1),
    decode_block_n=16,
    decode_num_stages=1,
    max_decode_splits=4,
    min_keys_per_split=16,
)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())
