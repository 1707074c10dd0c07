"""Turns a scheduler step into tensors and attention metadata, runs the model, and samples."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.decode_graphs import DecodeGraphs
from engine.host_copy import copy_to_device_async, copy_to_host_async
from engine.hybrid_block_manager import HybridBlockManager
from engine.interfaces.attention import AttentionMetadata
from engine.interfaces.block_cache import BlockCache, apply_block_moves
from engine.interfaces.model_runner import FlatStep, PlatformModelRunner
from engine.interfaces.ops import apply_token_bitmask as reference_apply_token_bitmask
from engine.kv_groups import KVGroupLayout
from engine.launched_step import DeferredSampling, LaunchedStep
from engine.lora.manager import LoraManager
from engine.parallel.micro_batches import forward_logits
from engine.parallel.step_mirror import StepMessage, step_message
from engine.pooling.pooler import PooledStep, pool_chunks, pooled_row_index
from engine.prefill_graphs import PrefillGraphs
from engine.prompt_logprobs import PromptLogprobs, score_prompt_rows
from engine.sampling.sampler import Sampler, SampleResult, SamplingRow
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.verify import SpecRows, Verified, verify, verify_greedy
from engine.step_inputs import StepInputs, prepare_step_inputs
from engine.verify_graphs import VerifyGraphs


class ModelRunner:
    """Runs steps of one model on one platform.

    Args:
        model: a model object with ``forward`` and ``compute_logits`` (see ``engine.models.llama``).
        block_cache: the platform's KV pool.
        block_manager: the block tables.
        sampler: turns logits into tokens.
        device: where input tensors go.
        sliding_window: the model's attention window, if any.
        apply_token_bitmask: the op table's token mask for structured output (the core's when None).
    """

    def __init__(
        self,
        model: object,
        block_cache: BlockCache,
        block_manager: BlockManager | HybridBlockManager,
        sampler: Sampler,
        device: torch.device,
        sliding_window: int | None = None,
        apply_token_bitmask: Callable[..., None] | None = None,
    ) -> None:
        self.model = model
        self.block_cache = block_cache
        self.block_manager = block_manager
        self.sampler = sampler
        self.device = device
        self.sliding_window = sliding_window
        #: the model's KV groups (None: one table per sequence); set with :meth:`use_kv_groups`
        self.kv_layout: KVGroupLayout | None = None
        self.apply_token_bitmask = apply_token_bitmask or reference_apply_token_bitmask
        #: set by the engine when the platform records graphs: pure-decode steps replay through it
        self.decode_graphs: DecodeGraphs | None = None
        #: set by the engine under speculative decoding when the platform records graphs: verification
        #: steps (rows of up to ``k + 1`` tokens) replay through it
        self.verify_graphs: VerifyGraphs | None = None
        #: set at start-up where the platform claims ``graph_capture_prefill``: a lone prompt chunk of up
        #: to 512 tokens replays through it
        self.prefill_graphs: PrefillGraphs | None = None
        #: set by the engine under tensor parallelism: sends each step to the other ranks before it runs here
        self.mirror: Callable[[StepMessage], None] | None = None
        #: pipeline parallelism: the micro-batches each step is cut into (1: the whole step at once)
        self.micro_batches = 1
        #: set by the engine under ``enable_lora``: the adapters' device slots
        self.lora: LoraManager | None = None
        #: set by the engine under EAGLE speculation: keeps each step's hidden states for the head
        #: (``engine.speculative.eagle_hidden.HiddenStore``: ``keep(step, hidden, metadata)``, ``needs_eager``)
        self.hidden_store: Any = None

    @property
    def layer_caches(self) -> list[Any]:
        """Each layer's KV cache tensor (with KV groups, layers of different groups share tensors)."""
        caches = self.block_cache.kv_caches
        return caches if self.kv_layout is None else self.kv_layout.layer_caches(caches)

    def use_kv_groups(self, layout: KVGroupLayout) -> None:
        """Run the model with one block table per KV group (the block manager must keep them)."""
        if len(self.block_manager.groups) != len(layout.groups):
            raise ValueError(f"the block manager keeps {len(self.block_manager.groups)} groups, the layout has {len(layout.groups)}")
        self.kv_layout = layout

    def prepare(
        self, step: SchedulerOutput, previous: LaunchedStep | None = None, graphs: DecodeGraphs | None = None
    ) -> StepInputs:
        """The step's flat batch on the runner's device (see :func:`engine.step_inputs.prepare_step_inputs`),
        a pure decode in the shape of ``graphs``' bucket."""
        return prepare_step_inputs(
            step,
            previous,
            block_manager=self.block_manager,
            device=self.device,
            scale=self.model.scale,
            sliding_window=self.sliding_window,
            kv_layout=self.kv_layout,
            lora_manager=self.lora,
            decode_shape=graphs.padded_shape if graphs is not None else None,
        )

    @torch.inference_mode()
    def launch(
        self,
        step: SchedulerOutput,
        generator: torch.Generator | None,
        previous: LaunchedStep | None = None,
        overlap: bool = False,
        generator_of: Callable[[Sequence], torch.Generator | None] | None = None,
        token_bitmask: Callable[[list[Sequence]], tuple[torch.Tensor, list[int]] | None] | None = None,
        defer_bitmask: bool = False,
    ) -> LaunchedStep:
        """Issue the step to the device.

        Args:
            step: what the scheduler picked.
            generator: the engine's generator for unseeded random rows.
            previous: the overlapped step still in flight, whose device tokens feed this step's rows.
            overlap: allow leaving the sampled tokens on the device (when every row samples greedily
                without host-side processing); otherwise the step is read back before returning.
            generator_of: a sequence's own generator (its request has a seed) or None; None: no
                sequence has one.
            token_bitmask: fills the host bitmask of the sampled rows (structured output): returns it
                with the constrained rows, or None when no row is constrained. It is called once the
                forward is issued, so on an asynchronous device the host fills it meanwhile.
            defer_bitmask: the matchers have not seen the tokens of the step in flight (``previous``):
                with ``token_bitmask`` the step is returned unsampled, and the caller, once it has read
                those tokens, calls :meth:`sample_deferred`.

        Returns:
            The launched step; :meth:`LaunchedStep.resolve` gives its tokens.
        """
        apply_block_moves(self.block_cache, step.swap_out, step.copies, step.swap_in)
        store = self.hidden_store
        # the core's model runs the whole step here (not a platform's runner, not pipeline micro-batches)
        whole_step = not isinstance(self.model, PlatformModelRunner) and self.micro_batches == 1
        graphs = self.decode_graphs if whole_step and (store is None or not store.needs_eager) else None
        inputs = self.prepare(step, previous, graphs)
        # rows whose logits are needed: the sampled ones, the verified ones, those scoring prompt tokens
        has_rows = bool(inputs.sample_targets or inputs.prompt_rows or inputs.spec_rows)
        # chosen before the step is mirrored: every rank must replay the same bucket's graph
        bucket = graphs.bucket_for(inputs.input_ids, inputs.metadata) if graphs is not None else None
        # (never under tensor parallelism: the other ranks record no verification graphs)
        verifying = self.verify_graphs if graphs is not None and bucket is None and self.mirror is None else None
        verify_bucket = verifying.bucket_for(inputs.metadata) if verifying is not None else None
        # a lone prompt chunk (not a pooling step's: its rows are pruned eagerly)
        unrecorded = graphs is not None and bucket is None and verify_bucket is None and self.mirror is None
        prefilling = self.prefill_graphs if unrecorded and not inputs.pool_rows else None
        prompt_bucket = prefilling.bucket_for(inputs.metadata) if prefilling is not None else None
        if self.mirror is not None:
            self.mirror(step_message(
                step.swap_out, step.copies, step.swap_in, inputs.input_ids, inputs.positions, inputs.metadata,
                inputs.logits_indices if has_rows else None, bucket,
            ))  # fmt: skip
        if inputs.pool_rows and not whole_step:
            raise RuntimeError("pooling requests need the core's model forward (not a platform runner or pipeline stages)")
        pooled: PooledStep | None = None
        # each token's greedy pick and logprob from the verification graph ([2, tokens], float64)
        picks: torch.Tensor | None = None
        greedy_verify = bool(inputs.spec_rows) and self._greedy_verifiable(inputs.spec_rows)
        if isinstance(self.model, PlatformModelRunner):
            # the platform runs the whole forward itself; it must run even when no row samples
            logits = self._platform_logits(inputs, inputs.logits_indices)
        elif self.micro_batches > 1:
            assert isinstance(inputs.metadata, AttentionMetadata), "pipeline stages keep one table per sequence"
            logits = forward_logits(
                self.model, self.layer_caches, inputs.input_ids, inputs.positions, inputs.metadata,
                inputs.logits_indices if has_rows else None, self.micro_batches,
            )  # fmt: skip
        else:
            hidden = None
            pruned: torch.Tensor | None = None  # the rows a pooling step's forward returned, when it pruned
            if graphs is not None and bucket is not None:  # run finds the same bucket again
                hidden = graphs.run(
                    inputs.input_ids, inputs.positions, inputs.metadata, inputs.lora, bucket, inputs.graph_inputs
                )
            elif verifying is not None and verify_bucket is not None:
                assert isinstance(inputs.metadata, AttentionMetadata)
                hidden, picks = verifying.run(inputs.input_ids, inputs.positions, inputs.metadata, verify_bucket)
                # every row verified greedily from the graph's picks: no logits to compute here
                if not (inputs.sample_targets or inputs.prompt_rows) and greedy_verify:
                    has_rows = False
            elif prefilling is not None and prompt_bucket is not None:
                hidden = prefilling.run(inputs.input_ids, inputs.positions, inputs.metadata, prompt_bucket)
            if hidden is None:
                if self.lora is not None:
                    self.model.use_lora_step(inputs.lora)
                pruned = self._pooled_rows(inputs, has_rows, store)
                rows = {} if pruned is None else {"output_rows": pruned}  # only models that prune take it
                hidden = self.model.forward(inputs.input_ids, inputs.positions, self.layer_caches, inputs.metadata, **rows)
            if store is not None:
                store.keep(step, hidden, inputs.metadata)
            pooled = pool_chunks(hidden, inputs.pool_rows, pruned is not None) if inputs.pool_rows else None
            if self.lora is not None:
                self.model.use_lora_logits(inputs.lora_logits)
            rows_kept = hidden if inputs.logits_all_rows else hidden.index_select(0, inputs.logits_indices)
            logits = self.model.compute_logits(rows_kept) if has_rows else None
        scored: list[PromptLogprobs] = []
        verified: list[tuple[Sequence, Verified]] = []
        sampled = len(inputs.sample_targets)
        if inputs.spec_rows:
            verified = self._verify(
                logits[sampled:] if logits is not None else None, inputs.spec_rows, generator,
                generator_of or _no_generator, greedy_verify, picks,
            )  # fmt: skip
        if inputs.prompt_rows:
            spec_count = sum(len(spec.drafts) + 1 for spec in inputs.spec_rows)
            scored = score_prompt_rows(logits[sampled + spec_count :], inputs.prompt_rows)
        if has_rows:
            logits = logits[:sampled]
        if not inputs.sample_targets:
            return LaunchedStep([], prompt_logprobs=scored, pooled=pooled, verified=verified)
        targets = inputs.sample_targets
        own = generator_of or _no_generator
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, own(s)) for s in targets]
        in_flight = overlap and self._can_overlap(targets, rows, token_bitmask is None)
        if token_bitmask is not None and defer_bitmask:
            # the masks read the matchers, which have not seen the step in flight's tokens yet: the engine
            # reads those, then samples this step (sample_deferred) while the device may still run it
            launched = LaunchedStep(targets, deferred=DeferredSampling(logits, rows, generator, in_flight))
        elif in_flight:
            launched = self._greedy_in_flight(targets, logits, token_bitmask, rows, generator)
        else:
            launched = LaunchedStep(targets, result=self._sample(logits, rows, generator, token_bitmask, targets))
        launched.prompt_logprobs, launched.pooled, launched.verified = scored, pooled, verified
        return launched

    def _pooled_rows(self, inputs: StepInputs, has_rows: bool, store: Any) -> torch.Tensor | None:
        """The rows a pooling-only step reads, for a model that can skip the others' last-layer work
        (:attr:`~engine.models.base.CausalLM.prunes_to_output_rows`); None to compute every row."""
        if not inputs.pool_rows or has_rows or store is not None or not getattr(self.model, "prunes_to_output_rows", False):
            return None
        index = pooled_row_index(inputs.pool_rows)
        return None if index is None else copy_to_device_async(index, inputs.input_ids.device)

    def _verify(
        self,
        logits: torch.Tensor | None,
        specs: list[SpecRows],
        generator: torch.Generator | None,
        generator_of: Callable[[Sequence], torch.Generator | None],
        greedy: bool,
        picks: torch.Tensor | None = None,
    ) -> list[tuple[Sequence, Verified]]:
        """Check each sequence's proposals against its rows of ``logits``: from greedy picks made on the
        device (the verification graph's ``picks`` of every token of the step, else picked here from
        ``logits``) when ``greedy`` (:meth:`_greedy_verifiable`), else on the host."""
        if greedy:
            if picks is not None:
                token_ids, values = picks.cpu().tolist()
                starts = [spec.first_row for spec in specs]
            else:
                assert logits is not None
                token_ids, logprobs = self.sampler.greedy_on_device(logits)
                both = torch.stack((token_ids.to(torch.float64), logprobs.to(torch.float64)))
                token_ids, values = both.cpu().tolist()
                starts = list(accumulate((len(spec.drafts) + 1 for spec in specs[:-1]), initial=0))
            out = []
            for spec, at in zip(specs, starts):
                end = at + len(spec.drafts) + 1
                chosen = [int(t) for t in token_ids[at:end]]
                out.append((spec.seq, verify_greedy(chosen, values[at:end], spec.drafts)))
            return out
        assert logits is not None
        host = logits.float().cpu()
        out, at = [], 0
        for spec in specs:
            count = len(spec.drafts) + 1
            seq = spec.seq
            row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, generator_of(seq))
            out.append((seq, verify(self.sampler, host[at : at + count], row, spec.drafts, generator)))
            at += count
        return out

    def _greedy_verifiable(self, specs: list[SpecRows]) -> bool:
        """Every sequence verifies greedily from device picks: greedy, nothing to process, no top logprobs."""
        rows = [SamplingRow(s.seq.params, s.seq.prompt_token_ids, s.seq.output_token_ids, None) for s in specs]
        return self.sampler.runs_on_any_device(rows) and all(row.params.logprobs is None for row in rows)

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None,
        token_bitmask: Callable[[list[Sequence]], tuple[torch.Tensor, list[int]] | None] | None,
        targets: list[Sequence],
    ) -> SampleResult:
        """The sampler on the step's (masked) logits; logprobs from the raw ones."""
        mask = token_bitmask(targets) if token_bitmask is not None else None
        raw_logits = None
        if mask is not None:
            raw_logits, logits = logits, self._masked(logits, mask)
        if not self.sampler.samples_on_device(rows):
            # seeded and processed rows sample with host generators and host-side bookkeeping; the others
            # are drawn on the device, which spares copying [rows, vocab] float32 logits to the host and
            # truncating them there (on a GPU, tens of milliseconds a step at a few hundred rows)
            logits = logits.cpu()
            raw_logits = raw_logits.cpu() if raw_logits is not None else None
        return self.sampler(logits, rows, generator, raw_logits)

    def sample_deferred(
        self, step: LaunchedStep, token_bitmask: Callable[[list[Sequence]], tuple[torch.Tensor, list[int]] | None]
    ) -> None:
        """Sample a step launched with ``defer_bitmask`` now that its masks can be filled: greedily on the
        device with its tokens left in flight when its rows allow, else read back at once."""
        deferred, step.deferred = step.deferred, None
        if deferred is None:
            raise ValueError("the step has no deferred sampling")
        if not deferred.in_flight:
            step.result = self._sample(deferred.logits, deferred.rows, deferred.generator, token_bitmask, step.targets)
            return
        done = self._greedy_in_flight(step.targets, deferred.logits, token_bitmask)
        step.token_ids, step.row_of, step._host, step._ready = done.token_ids, done.row_of, done._host, done._ready

    def _greedy_in_flight(
        self,
        targets: list[Sequence],
        logits: torch.Tensor,
        token_bitmask: Callable[[list[Sequence]], tuple[torch.Tensor, list[int]] | None] | None,
        rows: list[SamplingRow] | None = None,
        generator: torch.Generator | None = None,
    ) -> LaunchedStep:
        """Greedy picks left on the device (masked where a row is constrained; logprobs from the raw
        logits), or with ``rows`` that draw (unconstrained, :meth:`Sampler.draws_in_flight`) their draws,
        with a non-blocking copy to (pinned) host memory and an event: reading it later waits for this
        step only, not for the next step issued behind it."""
        mask = token_bitmask(targets) if token_bitmask is not None else None
        greedy = self.sampler.greedy_on_device
        if rows is not None and not all(r.params.greedy for r in rows):
            if mask is not None:
                raise ValueError("rows that draw are overlapped only without a token mask")
            token_ids, logprobs = self.sampler.draw_on_device(logits, rows, generator)
        elif mask is None:
            token_ids, logprobs = greedy(logits)
        else:
            # The raw log-normaliser of each row from one pass over the raw logits (its argmax's logit less
            # that token's logprob); the mask then goes on in place: no copy of the logits and no float32
            # log-softmax of them, which at batch 256 over a 128k vocabulary cost more than the fill.
            with torch.inference_mode():  # the logits are an inference tensor, masked in place
                raw_ids, raw_logprobs = greedy(logits)
                log_norm = logits.gather(1, raw_ids.view(-1, 1)).view(-1).float() - raw_logprobs
                target = logits if logits.is_contiguous() else logits.clone()
                self._apply_mask(target, mask)
                token_ids, _ = greedy(target)
                # an allowed token's logit is untouched by the mask: its raw logprob is logit - normaliser
                logprobs = target.gather(1, token_ids.view(-1, 1).to(torch.int64)).view(-1).float() - log_norm
        both = torch.stack((token_ids.to(torch.float64), logprobs.to(torch.float64)))
        host, ready = copy_to_host_async(both)
        row_of = {seq.seq_id: i for i, seq in enumerate(targets)}
        return LaunchedStep(targets, token_ids=token_ids, row_of=row_of, _host=host, _ready=ready)

    def mask_every_row(self, logits: torch.Tensor) -> None:
        """The structured-output mask over a copy of ``logits``, every token allowed: the start-up warm-up runs
        it, so that a platform's masking kernel compiles before the first constrained request rather than in
        its step."""
        rows, width = logits.shape
        self._apply_mask(logits.clone(), (torch.full((rows, -(-width // 32)), -1, dtype=torch.int32), list(range(rows))))

    def _masked(self, logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> torch.Tensor:
        """A copy of ``logits`` with each constrained row's disallowed tokens at ``-inf``."""
        masked = logits.clone()
        self._apply_mask(masked, mask)
        return masked

    def _apply_mask(self, logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
        """Set each constrained row's disallowed tokens to ``-inf`` in ``logits`` itself."""
        bitmask, masked_rows = mask
        indices = torch.tensor(masked_rows, dtype=torch.int64)
        if logits.device.type != "cpu":
            # from pageable memory a copy waits for the device to reach it (the forward in flight): pinned,
            # it queues behind it and the host goes on
            bitmask, indices = bitmask.pin_memory(), indices.pin_memory()
        device = logits.device
        self.apply_token_bitmask(logits, bitmask.to(device, non_blocking=True), indices.to(device, non_blocking=True))

    def _can_overlap(self, targets: list[Sequence], rows: list[SamplingRow], unmasked: bool = False) -> bool:
        """Rows that need nothing from the host to sample: greedy (or, ``unmasked``, drawn on the device
        with the engine's generator), unprocessed, no top logprobs, no forks."""
        samples = self.sampler.draws_in_flight(rows) if unmasked else self.sampler.runs_on_any_device(rows)
        return (
            samples
            and all(r.params.logprobs is None for r in rows)
            and not any(seq.pending_forks for seq in targets)
        )

    @torch.inference_mode()
    def prefill_logits(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (tests compare these with Hugging Face)."""
        inputs = self.prepare(step)
        if self.mirror is not None:
            every_row = torch.arange(inputs.input_ids.shape[0])
            self.mirror(step_message([], [], [], inputs.input_ids, inputs.positions, inputs.metadata, every_row))
        if isinstance(self.model, PlatformModelRunner):
            return self._platform_logits(inputs, torch.arange(inputs.input_ids.shape[0]))
        if self.micro_batches > 1:
            assert isinstance(inputs.metadata, AttentionMetadata)
            every_row = torch.arange(inputs.input_ids.shape[0], device=inputs.input_ids.device)
            logits = forward_logits(
                self.model, self.layer_caches, inputs.input_ids, inputs.positions, inputs.metadata, every_row,
                self.micro_batches,
            )  # fmt: skip
            assert logits is not None
            return logits.cpu()
        if self.lora is not None:
            self.model.use_lora_step(inputs.lora)
            self.model.use_lora_logits(inputs.lora)  # every row's logits
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.layer_caches, inputs.metadata)
        return self.model.compute_logits(hidden).cpu()

    def _platform_logits(self, inputs: StepInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        assert isinstance(inputs.metadata, AttentionMetadata), "a platform-run model has no KV groups"
        step = FlatStep.from_step_tensors(inputs.input_ids, inputs.positions, inputs.metadata, logits_indices)
        return self.model.compute_logits(step, self.block_cache)


def _no_generator(seq: Sequence) -> None:
    return None
