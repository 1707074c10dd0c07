"""Start-up warm-up: dummy forward passes of each batch kind before the first request.

A platform whose kernels compile on first use (Triton JIT, for example) would otherwise compile them
in the middle of serving, stalling every request in the step that first needs one: the first prefill,
the first batch that mixes decodes with a prefill, or the first eager decode at a longer context.
The largest pass also allocates the step's peak activation memory now rather than mid-serving.

Nothing here touches the KV cache: every slot is negative ("do not write", as for graph padding) and
every block table points at block 0, whose contents the discarded outputs may read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.lora import LoraStep
from engine.kv_groups import GroupedAttentionMetadata, KVGroupLayout, grouped_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmUpBatch:
    """One dummy step: ``query_lens[i]`` new tokens at the end of a ``seq_lens[i]``-token context."""

    name: str
    query_lens: list[int]
    seq_lens: list[int]


def warm_up_batches(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, eager_decode: bool,
    whole_prompts: bool = False,
) -> list[WarmUpBatch]:
    """The steps the warm-up runs, sized by the scheduler's limits.

    Args:
        max_num_batched_tokens: the step token budget; the prefill step fills it, shorter ones double up to it.
        max_num_seqs: most sequences in a step.
        max_model_len: longest context.
        block_size: tokens per KV block.
        eager_decode: whether pure-decode steps run eagerly (no decode graphs); then decode steps at
            contexts doubling from one block to ``max_model_len`` run too, since backends may pick
            launch shapes by context length.
        whole_prompts: the model runs whole prompts only (an encoder: no chunks, no decodes), so the
            prompt steps are the only shapes serving runs.

    Returns:
        The batches, in the order they run.
    """
    tokens = max(1, min(max_num_batched_tokens, max_num_seqs * max_model_len))
    prompts = _whole_prompts(tokens, max_num_seqs, max_model_len)
    batches = [WarmUpBatch("prefill", prompts, list(prompts))]
    # and prompt steps of 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48... tokens: a backend may pick a product's tiles by
    # the step's rows (a mixture of experts' grouped GEMM by its token-expert pairs), and each threshold lies
    # within a factor of two of some count here; between two powers of two a count that is a multiple of 16 and
    # one that is not, since a JIT may also compile a kernel apart for integers that are multiples of 16 (Triton
    # does); the shorter ones are one prompt, so the LM head runs over a single row too
    n = 2
    while n < tokens:
        for count in (n, n + 1, n + 16):
            if count < min(tokens, 2 * n):
                short = _whole_prompts(count, max_num_seqs, max_model_len)
                batches.append(WarmUpBatch(f"prefill-{count}", short, list(short)))
        n *= 2
    if whole_prompts:
        return batches
    # decodes first, then one prompt chunk: the scheduler's order for a step that mixes the two
    decodes = min(max_num_seqs - 1, tokens // 2)
    chunk = min(tokens - decodes, max_model_len)
    if decodes >= 1 and chunk >= 2:
        context = min(max_model_len, 4 * block_size)
        batches.append(WarmUpBatch("mixed", [1] * decodes + [chunk], [context] * decodes + [chunk]))
        # and fewer decodes beside the chunk, doubling from one: a backend may launch a few rows' attention
        # differently from many (the GPUs' decode kernel takes the leading decode rows only where they fill
        # the device, two KV heads a program only where they fill it twice over), and each threshold lies
        # within a factor of two of some count here
        n = 1
        while n < decodes:
            batches.append(WarmUpBatch(f"mixed-{n}", [1] * n + [chunk], [context] * n + [chunk]))
            n *= 2
    if eager_decode:
        context = min(block_size, max_model_len)
        while True:
            batches.append(WarmUpBatch(f"decode@{context}", [1], [context]))
            if context >= max_model_len:
                break
            context = min(2 * context, max_model_len)
        if max_num_seqs > 1:
            # and a full batch of them, as the mixed steps have both sizes
            short = min(block_size, max_model_len)
            batches.append(WarmUpBatch(f"decode-{max_num_seqs}", [1] * max_num_seqs, [short] * max_num_seqs))
    return batches


def _whole_prompts(tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of at most ``max_model_len`` tokens, at most ``max_num_seqs`` of them, that fill
    ``tokens`` (less where those limits stop it)."""
    full, rest = divmod(tokens, max_model_len)
    return [max_model_len] * min(full, max_num_seqs) + ([rest] if rest and full < max_num_seqs else [])


def _metadata(batch: WarmUpBatch, block_size: int, scale: float, sliding_window: int | None, device: torch.device) -> AttentionMetadata:
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    width = -(-max(batch.seq_lens) // block_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(batch.seq_lens), width), dtype=torch.int32, device=device),
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
        query_lens_cpu=list(batch.query_lens),
        seq_lens_cpu=list(batch.seq_lens),
        max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens),
        block_size=block_size,
        scale=scale,
        sliding_window=sliding_window,
    )


@torch.inference_mode()
def run_warm_up(
    model: object,
    kv_caches: list,
    batches: list[WarmUpBatch],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    kv_layout: KVGroupLayout | None = None,
    greedy: Callable[[torch.Tensor], object] | None = None,
    log: bool = True,
    mask: Callable[[torch.Tensor], object] | None = None,
    lora_slots: int = 0,
) -> float:
    """Run each batch through ``model.forward`` and the logits of its last rows; returns the seconds taken.

    Args:
        model: the core's torch model (``forward``, ``compute_logits``, ``scale``).
        kv_caches: the per-layer caches (read, never written).
        batches: from :func:`warm_up_batches`.
        block_size: tokens per KV block.
        device: where the inputs go.
        sliding_window: the model's attention window, if any.
        kv_layout: the model's KV groups, if it keeps a block table per group.
        greedy: the sampler's greedy pick on the device, run on each step's logits (a platform's fused
            pick compiles here rather than at the first greedy request).
        mask: structured output's token mask, run on each step's logits (the platform's masking kernel
            compiles here rather than at the first constrained request).
        log: log what ran and how long it took.
        lora_slots: the engine's adapter slots (``max_loras``; 0 without LoRA): then every row of every
            step reads slot 0, so that the adapter kernels launch here too (an empty slot's weights are
            zeros, and the outputs are discarded anyway).
    """
    start = time.perf_counter()
    # with adapters, the lm_head's and the embeddings' kernels run only for slots that update them
    live = model.lora_slots.every_part_in(0) if lora_slots else contextlib.nullcontext()
    try:
        with live:
            for batch in batches:
                _run_batch(model, kv_caches, batch, block_size, device, sliding_window, kv_layout, greedy, mask, lora_slots)
    finally:
        if lora_slots:
            model.use_lora_step(None)
            model.use_lora_logits(None)
    seconds = time.perf_counter() - start
    if log:
        logger.info("warm-up: %d dummy steps (%s) in %.1f s", len(batches), ", ".join(b.name for b in batches), seconds)
    return seconds


def _run_batch(
    model: object, kv_caches: list, batch: WarmUpBatch, block_size: int, device: torch.device,
    sliding_window: int | None, kv_layout: KVGroupLayout | None, greedy: Callable[[torch.Tensor], object] | None,
    mask: Callable[[torch.Tensor], object] | None, lora_slots: int,
) -> None:  # fmt: skip
    """One dummy step of :func:`run_warm_up`."""
    metadata: AttentionMetadata | GroupedAttentionMetadata = _metadata(batch, block_size, model.scale, sliding_window, device)
    if kv_layout is not None:
        n = len(kv_layout.groups)
        metadata = grouped_metadata(metadata, kv_layout, [metadata.block_tables] * n, [metadata.slot_mapping] * n)
    positions = torch.cat([
        torch.arange(s - n, s, dtype=torch.int64) for n, s in zip(batch.query_lens, batch.seq_lens, strict=True)
    ]).to(device)
    # token ids cycle through a small range that the vocabulary has (a test's tokenizer may have few)
    input_ids = positions % min(97, getattr(getattr(model, "config", None), "vocab_size", 97) or 97)
    if lora_slots:
        model.use_lora_step(_slot_zero(input_ids.shape[0], lora_slots, device))
    hidden = model.forward(input_ids, positions, kv_caches, metadata)
    first = metadata.primary if isinstance(metadata, GroupedAttentionMetadata) else metadata
    last = first.query_start_loc[1:].to(torch.int64) - 1
    rows = hidden.index_select(0, last)
    # reading the logits back waits for the step on any device: the time below is the real one; a
    # pooling model (an encoder, a headless decoder) has no LM head, so its hidden rows are read instead
    if getattr(model, "generates", True):
        if lora_slots:
            model.use_lora_logits(_slot_zero(rows.shape[0], lora_slots, device))
        logits = model.compute_logits(rows)
        if greedy is not None:
            greedy(logits)
        if mask is not None:
            mask(logits)
        logits.cpu()
    else:
        rows.cpu()


def _slot_zero(rows: int, num_slots: int, device: torch.device) -> LoraStep:
    """Every one of ``rows`` rows through adapter slot 0."""
    return LoraStep(torch.zeros(rows, dtype=torch.int32, device=device), (0,) * rows, num_slots)
