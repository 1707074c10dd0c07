"""The synchronous engine: requests in, one scheduler step at a time, outputs out.

The engine ties together what its own modules do: set-up (``engine_setup``: platform, model, KV pool,
scheduler, runner), input processing (``input_processor``: tokenization and the one request validator),
output processing (``output_processor``: text, logprobs, stop conditions, request outputs) and the
bookkeeping around a step (``step_results``: admission to the queue, a step's tokens into its sequences).
What is left here is the request lifecycle and the step loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from concurrent.futures import Future

from engine.beam_search import BeamSearcher, BeamSearchParams
from engine.config import EngineConfig
from engine.engine_setup import EngineConfigError, build_engine_parts
from engine.errors import InvalidRequestError
from engine.input_processor import InputProcessor
from engine.interfaces.platform import Platform
from engine.launched_step import LaunchedStep
from engine.loader.generation_defaults import format_generation_defaults, read_generation_defaults
from engine.lora.engine_adapters import EngineLoras
from engine.lora.request import LoRARequest
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.parallel.mp_workers import WorkerFailed
from engine.plugins.manager import PluginManager
from engine.plugins.selection import select_platform
from engine.pooling.config import read_pooler_config
from engine.pooling.engine_steps import PoolingSteps
from engine.pooling.params import PoolingParams
from engine.pooling.requests import PoolingRequests
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import make_generator
from engine.sequence import PENDING_TOKEN, Request, Sequence, SequenceStatus
from engine.speculative.speculator import Speculator
from engine.step_results import RequestAdmission, StepResults
from engine.structured_output.backend import StructuredOutputBackend
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

__all__ = ["EngineConfigError", "LLMEngine"]


class LLMEngine(PoolingSteps, RequestAdmission, StepResults):
    """Owns the model, the KV cache, the scheduler and every request's state.

    Not thread-safe: one thread calls :meth:`add_request`, :meth:`abort_request` and :meth:`step`.
    """

    def __init__(self, config: EngineConfig, platform: Platform, plugin_manager: PluginManager) -> None:
        parts = build_engine_parts(config, platform, plugin_manager)
        self.config = parts.config
        self.platform = platform
        self.model_path = parts.model_path
        self.model_name = parts.model_name
        self.model_config = parts.model_config
        self.dtype = parts.dtype
        self.device = parts.device
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.model = parts.model
        self.block_cache = parts.block_cache
        self.block_manager = parts.block_manager
        self.max_model_len = parts.max_model_len
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.runner = parts.runner
        #: the other tensor-parallel ranks' processes (None: this process runs the whole model)
        self.workers = parts.workers
        #: LoRA adapters (their manager is None when ``enable_lora`` is off)
        self.loras = EngineLoras(parts.lora)
        if parts.lora is not None:
            self.scheduler.max_loras = parts.lora.config.max_loras
        #: the checkpoint's sampling defaults for fields a request leaves unset (``generation_config``)
        self.generation_defaults: dict[str, float | int] = (
            read_generation_defaults(self.model_path) if self.config.generation_config == "auto" else {}
        )
        #: draws the tokens of unseeded random rows (a seeded request's sequences have their own)
        self.generator = make_generator(self.config.seed)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        #: speculative decoding (None: off)
        self.speculator = (
            Speculator(self.config.speculative_config, self.max_model_len, parts.draft)
            if self.config.speculative_config is not None
            else None
        )
        #: pooling (embedding) requests' accumulated chunks, with the model's declared pooling
        if hasattr(self.model, "sep_token_id"):
            # a cross-encoder's second text is token type 1: the model finds it after the first [SEP]
            self.model.sep_token_id = getattr(getattr(self.tokenizer, "hf", None), "sep_token_id", None)
        self.pooling = PoolingRequests(
            read_pooler_config(self.model_path, getattr(self.model, "default_pooling_type", "LAST")),
            getattr(self.model, "classification_head", None),
        )
        #: the last step's pooled chunks, read once the next step is issued (see :meth:`_read_pooled`)
        self._pooled_in_flight = None
        #: structured output: compiled grammars and the constrained sequences' matchers
        self.structured = StructuredOutputManager(
            self._make_structured_backend, pin_memory=self.device.type != "cpu"
        )
        #: constrained requests whose grammar is still compiling, kept out of the scheduler until it is
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        #: the overlapped step whose tokens are still on the device (see :meth:`step`)
        self._in_flight: LaunchedStep | None = None
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        #: the generation settings every pooling request's sequence carries (the scheduler reads them; it
        #: never changes them), built once: a SamplingParams is validated as it is built, 65 us each
        self._pooling_step_params = SamplingParams(max_tokens=1)
        self.beams = BeamSearcher(
            self.scheduler, self.block_manager, self.eos_token_ids,
            lambda: next(self._seq_ids), lambda: next(self._arrivals),
        )  # fmt: skip
        logger.info(
            "engine ready: %s on %s, %s, %d KV blocks of %d tokens, steps of up to %d tokens and %d sequences",
            self.model_name, platform.name, self.config.dtype, parts.num_blocks, self.config.cache.block_size,
            self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs,
        )  # fmt: skip
        if self.generation_defaults:
            logger.info(
                "using the checkpoint's generation defaults: %s", format_generation_defaults(self.generation_defaults)
            )

    @classmethod
    def from_config(cls, config: EngineConfig, plugin_manager: PluginManager | None = None) -> LLMEngine:
        """Select the platform named by ``config.device`` and build the engine on it."""
        manager = plugin_manager or PluginManager()
        platform = select_platform(config.device, manager)
        manager.hook.engine_configure(platform=platform, config=config)
        return cls(config, platform, manager)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and the grammar compile threads; safe to call twice (an
        engine dropped without it stops its workers when it is garbage-collected or the process exits)."""
        if self.workers is not None:
            self.workers.close()
        self.structured.shutdown()

    # --- requests ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.beams.groups)

    def validate_request(
        self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> list[int]:
        """Tokenize and check a request without queueing it (see :meth:`InputProcessor.validate`).

        Returns:
            The prompt token ids.

        Raises:
            InvalidRequestError: for an empty prompt, token ids outside the vocabulary, a prompt that
                (with ``max_tokens``) does not fit the context, or an empty ``cache_salt``.
        """
        token_ids = self.input_processor.validate(prompt, params, cache_salt)
        self._compile_constraint(params)
        return token_ids

    def tokenize_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids, the texts encoded in one batch (pass them to :meth:`add_request` as
        ``prompt_token_ids``, which checks them).

        Raises:
            InvalidRequestError: an empty text, or one too long for the context before tokenizing.
        """
        return self.input_processor.tokenize_many(prompts)

    def _compile_constraint(self, params: SamplingParams) -> Future | None:
        """Check a request's structured output now and compile it in the background (None: unconstrained).

        Raises:
            InvalidRequestError: the constraint is invalid; the message names the problem.
        """
        if params.structured_outputs is None:
            return None
        try:
            return self.structured.compile(params.structured_outputs)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="structured_outputs") from None

    def _make_structured_backend(self) -> StructuredOutputBackend:
        from engine.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        priority: int = 0,
        final_only: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; it runs from the next :meth:`step`.

        Args:
            params: sampling settings, or beam search settings (the output then holds ``beam_width``
                hypotheses, best first).
            priority: lower runs first; equal priorities run in arrival order (FCFS).
            final_only: :meth:`step` returns this request's output only once it finished (what offline
                callers read); saves building an output and decoding text per token.
            cache_salt: the request's prefix cache is shared only with requests of the same salt
                (None: with every unsalted request).
            lora_request: the LoRA adapter it runs under (registered and loaded on first use), None for
                the base model.
            prompt_token_ids: a text prompt's ids, already tokenized (:meth:`tokenize_prompts`): they are
                checked again but not re-encoded; the text is kept for the outputs.

        Raises:
            InvalidRequestError: see :meth:`validate_request`, a duplicate request id, ``n`` (the beam
                width) larger than ``max_waiting_requests``, which could never be queued, or an adapter
                that cannot be used (LoRA off, unreadable, not fitting the model).
            QueueFullError: the waiting queue is at ``max_waiting_requests``; every kind of request counts.
        """
        if request_id in self.requests or request_id in self.beams.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            if self.config.runner == "generate":
                raise InvalidRequestError("this engine runs generation only (runner='generate'); pooling requests need runner 'pooling' or 'auto'")
            self._add_pooling(request_id, prompt, params, priority, cache_salt, lora_request, prompt_token_ids)
            return
        if not getattr(self.model, "generates", True):
            raise InvalidRequestError(
                f"{self.model_config.architecture} has no LM head: it serves embeddings (LLM.embed, /v1/embeddings), not generation"
            )
        if self.config.runner == "pooling":
            raise InvalidRequestError("this engine runs pooling requests only (runner='pooling'): embeddings, classification and scores")
        source = prompt if prompt_token_ids is None else prompt_token_ids
        if isinstance(params, BeamSearchParams):
            token_ids = self.validate_request(source, params.step_params(), cache_salt)
            self._admit(params.beam_width, "the beam width (n)")
            if lora_request is not None:
                self.loras.add(lora_request)  # a broken adapter is refused before the group exists
            root = self.beams.add(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, cache_salt)
            self.loras.tag([root], lora_request)  # the beams forked from it inherit the adapter
            return
        token_ids = self.validate_request(source, params, cache_salt)
        self._admit(params.n, "n")
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, final_only=final_only)
        arrival = next(self._arrivals)
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                prompt_token_ids=token_ids,
                params=params,
                arrival=arrival,
                priority=priority,
                cache_salt=cache_salt,
            )
            request.sequences.append(seq)
        self.loras.tag(request.sequences, lora_request)
        self.output_processor.add_request(request)
        # Only the first sequence prefills; its siblings take its prompt blocks by reference once that is
        # done (copy-on-write on the shared last block), and sample their first token from its logits.
        first, *siblings = request.sequences
        first.pending_forks = siblings
        self.requests[request_id] = request
        grammar = self._compile_constraint(params)
        if grammar is not None:
            # it waits here, not in the scheduler, so the other requests run while its grammar compiles;
            # the next step queues it once it is (at once for a grammar compiled before)
            self._awaiting_grammar[request_id] = (request, grammar)
            return
        self.scheduler.add(first)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter (False: it already is). Raises ``InvalidRequestError`` for one that
        cannot be used (the engine is unchanged)."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (False: unknown). Raises ``InvalidRequestError`` while requests run under it."""
        return self.loras.remove(lora_id, (seq for r in self.requests.values() for seq in r.sequences))

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters."""
        return self.loras.list()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.beams.abort(rid):
                continue
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self._awaiting_grammar.pop(rid, None)
            for seq in request.sequences:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
            if self.speculator is not None:
                self.speculator.finished(*request.sequences, aborted=True)
            self.structured.release(request.sequences)
            self.pooling.discard(rid)
            # nothing reports on it any more: its output state goes with it
            self.output_processor.release(request)

    # --- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for each request that produced tokens.

        With async scheduling a step whose rows all sample greedily on the device is left in flight:
        the next call issues the following step first (its rows read those tokens on the device) and
        only then reads them back, so the host's work overlaps the device's. Outputs then arrive one
        call later; the tokens are the same.

        Raises:
            WorkerFailed: a tensor-parallel rank exited (its collective failed here; the engine cannot
                go on).
        """
        try:
            return self._step()
        except RuntimeError as exc:
            failure = self.workers.failure() if self.workers is not None else None
            if failure is None:
                raise
            raise WorkerFailed(f"{failure}; the engine cannot go on") from exc

    def _step(self) -> list[RequestOutput]:
        failed = self._admit_compiled()
        plan = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        launched = None
        token_bitmask = self.structured.fill_bitmask if self.structured.num_matchers else None
        if not plan.is_empty:
            overlap = self.config.scheduler.async_scheduling and not self.beams.groups
            if self.speculator is not None:
                # proposals need each step read before the next is scheduled; a step without them may overlap
                overlap = self.speculator.begin_step(plan) and overlap
            launched = self.runner.launch(
                plan, self.generator, previous, overlap=overlap, generator_of=self.output_processor.generator_of,
                token_bitmask=token_bitmask, defer_bitmask=previous is not None,
            )  # fmt: skip
        touched: dict[str, Request] = {r.request_id: r for r in failed}
        if launched is not None:
            for scored in launched.prompt_logprobs:
                self.output_processor.add_prompt_logprobs(scored)
            if launched.pooled is not None:
                self._end_pooled(launched.pooled)
        if previous is not None:
            self._take_samples(previous, touched)
        if launched is not None and launched.deferred is not None:
            # the matchers have now seen the previous step's tokens: this step's masks can be filled
            assert token_bitmask is not None
            self.runner.sample_deferred(launched, token_bitmask)
        if launched is not None:
            self.scheduler.advance(plan)
            if not launched.overlapped:
                self._take_samples(launched, touched)
        make_output = self.output_processor.make_output
        outputs = [make_output(r) for r in touched.values() if not r.final_only or r.is_finished]
        if launched is not None and launched.overlapped:
            for seq in launched.targets:
                # a sequence the previous step's tokens finished has its extra row dropped
                if not seq.is_finished:
                    seq.output_token_ids.append(PENDING_TOKEN)
                    seq.last_token_in_flight = self._length_reached(seq)
            self._in_flight = launched
        for out in outputs:
            if out.finished:
                self.output_processor.release(done := self.requests.pop(out.request_id))
                if self.speculator is not None:
                    self.speculator.finished(*done.sequences)
        for out in self.beams.expand_ready():
            for c in out.outputs:
                c.text = self.tokenizer.decode(c.token_ids)
            outputs.append(out)
        outputs.extend(self._read_pooled(launched.pooled if launched is not None else None))  # type: ignore[arg-type]
        return outputs

    def _length_reached(self, seq: Sequence) -> bool:
        """Whether ``seq`` ends by length with the token it has in flight (``max_tokens`` or the context
        limit): then no step is scheduled for it after that one, which would compute a row only to drop it."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and len(seq.output_token_ids) >= max_tokens) or seq.num_tokens >= self.max_model_len

    def stats(self) -> dict[str, int | float]:
        """Counters for the server's metrics."""
        sched, bm = self.scheduler, self.block_manager
        stats: dict[str, int | float] = {
            "num_running": len(sched.running),
            "num_waiting": sched.num_waiting,
            "num_swapped": len(sched.swapped),
            "num_free_blocks": self.num_free_blocks,
            "num_total_blocks": self.num_total_blocks,
            "kv_cache_usage": round(bm.usage, 4),
            "prefix_cache_queried_tokens": bm.prefix_stats.queried_tokens,
            "prefix_cache_hit_tokens": bm.prefix_stats.hit_tokens,
            "prefix_cache_hit_rate": round(bm.prefix_stats.hit_rate, 4),
            "num_preemptions": sched.num_preemptions,
            "num_swaps_out": sched.num_swaps_out,
        }
        if self.speculator is not None:
            stats.update(self.speculator.stats())  # type: ignore[arg-type]
        return stats
