"""Turns a scheduler step into tensors and attention metadata, runs the model, and samples."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from engine.block_manager import BlockManager
from engine.decode_graphs import DecodeGraphs
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.block_cache import BlockCache
from engine.interfaces.model_runner import FlatStep, PlatformModelRunner
from engine.sampling.sampler import Sampler, SampleResult, SamplingRow
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    """The flat batch of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    #: the sequence each logits row is sampled for: a sequence whose chunk reached its end, and any
    #: siblings waiting to fork from it (they sample their first token from the same logits)
    sample_targets: list[Sequence]


class ModelRunner:
    """Runs steps of one model on one platform.

    Args:
        model: a model object with ``forward`` and ``compute_logits`` (see ``engine.models.llama``).
        block_cache: the platform's KV pool.
        block_manager: the block tables.
        sampler: turns logits into tokens.
        device: where input tensors go.
        sliding_window: the model's attention window, if any.
    """

    def __init__(
        self,
        model: object,
        block_cache: BlockCache,
        block_manager: BlockManager,
        sampler: Sampler,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> None:
        self.model = model
        self.block_cache = block_cache
        self.block_manager = block_manager
        self.sampler = sampler
        self.device = device
        self.sliding_window = sliding_window
        #: set by the engine when the platform records graphs: pure-decode steps replay through it
        self.decode_graphs: DecodeGraphs | None = None

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        # Host work here is per sequence and per step, so at a few hundred sequences it competes with the
        # GPU's step time: one-token rows (decodes) take a short path, and tensors cross in two copies.
        bm = self.block_manager
        bs = bm.block_size
        block_tables = bm.block_tables
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        targets: list[Sequence] = []
        offset = 0
        for item in step.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            tables.append(table)
            query_lens.append(n)
            if n == 1:
                prompt_len = len(seq.prompt_token_ids)
                input_ids.append(
                    seq.prompt_token_ids[start] if start < prompt_len else seq.output_token_ids[start - prompt_len]
                )
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                seq_lens.append(start + 1)
            else:
                end = start + n
                input_ids.extend(seq.token_slice(start, end))
                positions.extend(range(start, end))
                # slots block by block rather than token by token: a long prefill is a few list extends
                pos = start
                while pos < end:
                    block_idx, within = divmod(pos, bs)
                    run = min(bs - within, end - pos)
                    base = table[block_idx] * bs + within
                    slots.extend(range(base, base + run))
                    pos += run
                seq_lens.append(end)
            offset += n
            if item.samples:
                logits_indices.append(offset - 1)
                targets.append(seq)
                for sibling in seq.pending_forks:
                    logits_indices.append(offset - 1)
                    targets.append(sibling)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        width = max(len(t) for t in tables)
        padded_tables = chain.from_iterable(t + [0] * (width - len(t)) if len(t) < width else t for t in tables)
        # Everything crosses in one int64 transfer (each copy is a fixed cost that batch-1 decode pays
        # every token); the int32 fields are cast on the device.
        parts = (input_ids, positions, slots, logits_indices, qsl, seq_lens)
        sizes = [len(p) for p in parts] + [len(tables) * width]
        packed = torch.tensor(list(chain(*parts, padded_tables)), dtype=torch.int64).to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, logits_t, qsl_t, seq_lens_t, tables_t = packed.split(sizes)
        table_tensor = tables_t.view(len(tables), width).to(torch.int32)
        metadata = AttentionMetadata(
            query_start_loc=qsl_t.to(torch.int32),
            seq_lens=seq_lens_t.to(torch.int32),
            block_tables=table_tensor,
            slot_mapping=slots_t,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
        )
        return StepInputs(
            input_ids=ids_t,
            positions=pos_t,
            metadata=metadata,
            logits_indices=logits_t,
            sample_targets=targets,
        )

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, generator: torch.Generator | None
    ) -> tuple[list[Sequence], SampleResult | None]:
        """Run the step; returns the sequences that sampled and their tokens (None if none sampled)."""
        # Order matters: a block freed by a swap-out or a copy-on-write may be reused in this same step.
        if step.swap_out:
            self.block_cache.swap_out(step.swap_out)
        if step.copies:
            self.block_cache.copy_blocks(step.copies)
        if step.swap_in:
            self.block_cache.swap_in(step.swap_in)
        inputs = self.prepare(step)
        if isinstance(self.model, PlatformModelRunner):
            # the platform runs the whole forward itself; it must run even when no row samples
            logits = self._platform_logits(inputs, inputs.logits_indices)
            if not inputs.sample_targets:
                return [], None
        else:
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
            if hidden is None:
                hidden = self.model.forward(inputs.input_ids, inputs.positions, self.block_cache.kv_caches, inputs.metadata)
            if not inputs.sample_targets:
                return [], None
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in inputs.sample_targets]
        if not self.sampler.runs_on_any_device(rows):
            # seeded and processed rows sample with host generators and host-side bookkeeping
            logits = logits.cpu()
        return inputs.sample_targets, self.sampler(logits, rows, generator)

    @torch.inference_mode()
    def prefill_logits(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (tests compare these with Hugging Face)."""
        inputs = self.prepare(step)
        if isinstance(self.model, PlatformModelRunner):
            return self._platform_logits(inputs, torch.arange(inputs.input_ids.shape[0]))
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.block_cache.kv_caches, inputs.metadata)
        return self.model.compute_logits(hidden).cpu()

    def _platform_logits(self, inputs: StepInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        step = FlatStep.from_step_tensors(inputs.input_ids, inputs.positions, inputs.metadata, logits_indices)
        return self.model.compute_logits(step, self.block_cache)
