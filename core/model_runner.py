"""Turns a scheduler step into tensors and attention metadata, runs the model, and samples."""

from __future__ import annotations

from dataclasses import dataclass

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
        bm = self.block_manager
        bs = bm.block_size
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
            end = start + n
            table = bm.block_tables[seq.seq_id]
            input_ids.extend(seq.token_slice(start, end))
            positions.extend(range(start, end))
            # Slots block by block rather than token by token: a long prefill is a few list extends.
            pos = start
            while pos < end:
                block_idx, within = divmod(pos, bs)
                run = min(bs - within, end - pos)
                base = table[block_idx] * bs + within
                slots.extend(range(base, base + run))
                pos += run
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            offset += n
            if item.samples:
                for target in (seq, *seq.pending_forks):
                    logits_indices.append(offset - 1)
                    targets.append(target)
        max_blocks = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table_tensor.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
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
