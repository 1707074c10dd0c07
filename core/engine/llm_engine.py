"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

import torch

from engine.beam_search import BeamSearcher, BeamSearchParams
from engine.block_manager import BlockManager
from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.errors import InvalidRequestError, QueueFullError
from engine.interfaces.block_cache import KVCacheSpec
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.model_runner import PlatformModelRunner
from engine.interfaces.ops import reference_ops
from engine.interfaces.platform import Platform
from engine.loader import dummy_weights, iter_weights, load_model_config, load_tokenizer, resolve_model_path
from engine.loader.errors import ModelLoadError
from engine.loader.fp8 import FP8_E4M3_SCHEME, quantize_fp8_per_channel
from engine.model_runner import LaunchedStep, ModelRunner
from engine.models.registry import model_registry, supported_architectures
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.plugins.manager import PluginManager
from engine.plugins.selection import select_platform
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler, SampleResult, check_params_against_vocab, make_generator
from engine.sampling.stop import StopChecker
from engine.scheduler import Scheduler
from engine.sequence import PENDING_TOKEN, Request, Sequence, SequenceStatus
from engine.warm_up import run_warm_up, warm_up_batches

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {name: getattr(torch, name) for name in KV_CACHE_DTYPES}


class EngineConfigError(ValueError):
    """The configuration cannot run on the selected platform; the message lists every reason."""


def _fp8_quantizer(platform_name: str, gemm: GemmBackend, model: object) -> Callable[[torch.Tensor], QuantizedWeight]:
    """The load-time FP8 quantizer for ``quantization="fp8"``, once the platform is known to run it.

    Raises:
        EngineConfigError: when the platform's GEMM does not run FP8 weights, or the platform runs the
            model itself.
    """
    if FP8_E4M3_SCHEME not in gemm.supported_quant_schemes or not hasattr(model, "linear_quantizer"):
        runs = ", ".join(sorted(gemm.supported_quant_schemes)) or "none"
        raise EngineConfigError(
            f"quantization 'fp8' needs FP8 ({FP8_E4M3_SCHEME}) matmuls, which {platform_name} does not run "
            f"here (its quantized schemes: {runs})"
        )
    return quantize_fp8_per_channel


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every request's state.

    Not thread-safe: one thread calls :meth:`add_request`, :meth:`abort_request` and :meth:`step`.
    """

    def __init__(self, config: EngineConfig, platform: Platform, plugin_manager: PluginManager) -> None:
        self.config = config
        self.platform = platform
        self.model_path = resolve_model_path(config.model)
        self.model_config = load_model_config(self.model_path, check_weights=config.load_format != "dummy")
        registry = model_registry(plugin_manager.extra_models())
        arch = self.model_config.architecture
        if arch not in registry:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures(plugin_manager.extra_models()))}"
            )
        dtype_name = config.dtype if config.dtype != "auto" else platform.capabilities().dtypes[0]
        self.config = config = config.model_copy(update={"dtype": dtype_name})
        reasons = platform.validate(config)
        head_sizes = platform.capabilities().head_sizes
        if self.model_config.head_dim not in head_sizes:
            reasons.append(f"head size {self.model_config.head_dim} is not supported on {platform.name} (supported: {list(head_sizes)})")
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            reasons.append(f"max_model_len {config.max_model_len} exceeds the model's context length {model_max}")
        if reasons:
            raise EngineConfigError("; ".join(reasons))
        self.dtype = _DTYPES[dtype_name]
        self.device = platform.torch_device()
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = list(dict.fromkeys(self.model_config.eos_token_ids + self.tokenizer.eos_token_ids))
        self._window_decoder = self.tokenizer.window_decoder()

        attention = platform.make_attention_backend()
        gemm = platform.make_gemm_backend()
        ops = reference_ops().with_overrides(platform.op_overrides())
        # a platform may run the whole forward itself (JAX); otherwise the core's torch model runs on its backends
        self.model = platform.make_model_runner(self.model_config, dtype_name) or registry[arch](
            self.model_config, ops, attention, gemm, self.dtype, self.device
        )
        if config.quantization == "fp8":
            self.model.linear_quantizer = _fp8_quantizer(platform.name, gemm, self.model)
        # quantized matrices stay quantized only for the schemes this platform's GEMM runs itself
        keep_quantized = gemm.supported_quant_schemes if config.quantization == "auto" else frozenset()
        weights = (
            dummy_weights(self.model_config, seed=config.seed, dtype=self.dtype, device=self.device)
            if config.load_format == "dummy"
            else iter_weights(self.model_path, self.model_config, keep_quantized=keep_quantized)
        )
        self.model.load_weights(weights)

        kv_dtype = _KV_DTYPES[config.cache.kv_cache_dtype or dtype_name]
        spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            block_size=config.cache.block_size,
            dtype=kv_dtype,
        )
        num_blocks = self._num_kv_blocks(spec, config.max_model_len or model_max)
        self.block_cache = platform.make_block_cache(spec, num_blocks, attention)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        capacity = num_blocks * config.cache.block_size
        self.max_model_len = min(config.max_model_len or model_max, capacity)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.block_cache.num_host_blocks)
        self.sampler = Sampler(self.eos_token_ids, self.model_config.vocab_size, ops.greedy_pick)
        self.generator = make_generator(config.seed)
        self.runner = ModelRunner(
            self.model, self.block_cache, self.block_manager, self.sampler, self.device, self.model_config.sliding_window
        )
        if not config.enforce_eager and platform.capabilities().graph_capture and not isinstance(self.model, PlatformModelRunner):
            self.runner.decode_graphs = DecodeGraphs(
                self.model, self.block_cache.kv_caches, platform.make_graph_capture(), config.scheduler.max_num_seqs,
                self.max_model_len, config.cache.block_size, self.device, self.model_config.sliding_window,
            )  # fmt: skip
            self.runner.decode_graphs.capture()
        if platform.capabilities().warm_up and not isinstance(self.model, PlatformModelRunner):
            batches = warm_up_batches(
                config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, self.max_model_len,
                config.cache.block_size, eager_decode=self.runner.decode_graphs is None,
            )  # fmt: skip
            try:
                run_warm_up(self.model, self.block_cache.kv_caches, batches, config.cache.block_size, self.device, self.model_config.sliding_window)
            except torch.OutOfMemoryError as exc:
                # found at start-up rather than by the first long prompt mid-serving
                raise EngineConfigError(
                    f"a step of {config.scheduler.max_num_batched_tokens} tokens does not fit in the device memory "
                    "left beside the KV cache; lower --max-num-batched-tokens or --kv-cache-memory"
                ) from exc
        self.requests: dict[str, Request] = {}
        #: the overlapped step whose tokens are still on the device (see :meth:`step`)
        self._in_flight: LaunchedStep | None = None
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.beams = BeamSearcher(
            self.scheduler, self.block_manager, self.eos_token_ids,
            lambda: next(self._seq_ids), lambda: next(self._arrivals),
        )
        name = self.model_path.rstrip("/").split("/")[-1]
        self.model_name = name[: -len(".gguf")] if name.endswith(".gguf") else name
        logger.info("engine ready: %s on %s, %s, %d KV blocks of %d tokens", self.model_name, platform.name, dtype_name, num_blocks, config.cache.block_size)

    @classmethod
    def from_config(cls, config: EngineConfig, plugin_manager: PluginManager | None = None) -> LLMEngine:
        """Select the platform named by ``config.device`` and build the engine on it."""
        manager = plugin_manager or PluginManager()
        platform = select_platform(config.device, manager)
        manager.hook.engine_configure(platform=platform, config=config)
        return cls(config, platform, manager)

    def _num_kv_blocks(self, spec: KVCacheSpec, max_len: int) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        per_block = spec.bytes_per_block(self.platform.element_size(spec.dtype))
        budget = cache.kv_cache_memory_bytes or self.platform.default_kv_cache_bytes()
        if budget is None:
            budget = int(self.platform.free_memory_bytes() * cache.memory_fraction)
        num_blocks = budget // per_block
        # More blocks than every sequence at full length could use is memory taken for nothing.
        useful = self.config.scheduler.max_num_seqs * -(-max_len // spec.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise EngineConfigError(f"the KV cache budget of {budget} bytes is smaller than one block ({per_block} bytes)")
        return num_blocks

    # --- requests ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.beams.groups)

    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request without queueing it.

        Returns:
            The prompt token ids.

        Raises:
            InvalidRequestError: for an empty prompt, token ids outside the vocabulary, or a prompt that
                (with ``max_tokens``) does not fit the context.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the context length is {self.max_model_len}; "
                "at least one token must be left to generate",
                param="prompt",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}",
                param="max_tokens",
            )
        check_params_against_vocab(params, vocab)
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        priority: int = 0,
        final_only: bool = False,
    ) -> None:
        """Queue a request; it runs from the next :meth:`step`.

        Args:
            params: sampling settings, or beam search settings (the output then holds ``beam_width``
                hypotheses, best first).
            priority: lower runs first; equal priorities run in arrival order (FCFS).
            final_only: :meth:`step` returns this request's output only once it finished (what offline
                callers read); saves building an output and decoding text per token.

        Raises:
            InvalidRequestError: see :meth:`validate_request`, or a duplicate request id.
            QueueFullError: the waiting queue is at ``max_waiting_requests``.
        """
        if request_id in self.requests or request_id in self.beams.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(params, BeamSearchParams):
            token_ids = self.validate_request(prompt, params.step_params())
            self.beams.add(request_id, prompt if isinstance(prompt, str) else None, token_ids, params)
            return
        token_ids = self.validate_request(prompt, params)
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.scheduler.num_waiting + params.n > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
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
            )
            if params.seed is not None:
                seq.generator = make_generator(params.seed + index)
            seq.detokenizer = IncrementalDetokenizer(self._window_decoder, token_ids, params.skip_special_tokens)
            seq.stop_checker = StopChecker(params, self.eos_token_ids, self.max_model_len)
            seq.defer_text = final_only and not params.stop
            if params.logprobs is not None:
                seq.logprobs = []
            request.sequences.append(seq)
        # Only the first sequence prefills; its siblings take its prompt blocks by reference once that is
        # done (copy-on-write on the shared last block), and sample their first token from its logits.
        first, *siblings = request.sequences
        first.pending_forks = siblings
        self.scheduler.add(first)
        self.requests[request_id] = request

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.beams.abort(rid):
                continue
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.sequences:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"

    # --- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for each request that produced tokens.

        With async scheduling a step whose rows all sample greedily on the device is left in flight:
        the next call issues the following step first (its rows read those tokens on the device) and
        only then reads them back, so the host's work overlaps the device's. Outputs then arrive one
        call later; the tokens are the same.
        """
        plan = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        launched = None
        if not plan.is_empty:
            overlap = self.config.scheduler.async_scheduling and not self.beams.groups
            launched = self.runner.launch(plan, self.generator, previous, overlap=overlap)
        touched: dict[str, Request] = {}
        if previous is not None:
            self._take_samples(previous, touched)
        if launched is not None:
            self.scheduler.advance(plan)
            if not launched.overlapped:
                self._take_samples(launched, touched)
        outputs = [self._make_output(r) for r in touched.values() if not r.final_only or r.is_finished]
        if launched is not None and launched.overlapped:
            for seq in launched.targets:
                # a sequence the previous step's tokens finished has its extra row dropped
                if not seq.is_finished:
                    seq.output_token_ids.append(PENDING_TOKEN)
            self._in_flight = launched
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        for out in self.beams.expand_ready():
            for c in out.outputs:
                c.text = self.tokenizer.decode(c.token_ids)
            outputs.append(out)
        return outputs

    def _take_samples(self, launched: LaunchedStep, touched: dict[str, Request]) -> None:
        """Append a step's sampled tokens to their sequences (replacing the placeholders of an overlapped step)."""
        result = launched.resolve()
        if result is None:
            return
        for i, seq in enumerate(launched.targets):
            if launched.overlapped:
                if seq.is_finished or not seq.output_token_ids or seq.output_token_ids[-1] != PENDING_TOKEN:
                    continue  # finished or aborted while the step was in flight
                seq.output_token_ids.pop()
            if self.beams.owns(seq):
                self.beams.on_sampled(seq, result.top_logprobs[i])
                continue
            if seq.pending_forks:
                self._fork_siblings(seq)
            self._append_token(seq, result, i)
            request = self.requests.get(seq.request_id)
            if request is not None:
                touched[seq.request_id] = request

    def _fork_siblings(self, parent: Sequence) -> None:
        for child in parent.pending_forks:
            self.block_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.add_running(child)
        parent.pending_forks = []

    def _append_token(self, seq: Sequence, result: SampleResult, i: int) -> None:
        token = result.token_ids[i]
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += result.logprobs[i]
        if seq.logprobs is not None:
            entry = {token: Logprob(result.logprobs[i], result.ranks[i], self.tokenizer.decode([token], skip_special_tokens=False))}
            for rank, (tid, lp) in enumerate(result.top_logprobs[i] or (), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
            seq.logprobs.append(entry)
        new_text = "" if seq.defer_text else seq.detokenizer.step(token)
        seq.text += new_text
        decision = seq.stop_checker.check(seq.output_token_ids, seq.num_tokens, seq.text, len(new_text))
        if decision is None:
            return
        if seq.defer_text:
            # decoded only now (no stop strings needed it earlier); an EOS or stop token ends the text
            # before its own text, as the per-token path cuts it
            ids = seq.output_token_ids
            cut = decision.finish_reason == "stop" and not seq.params.include_stop_str_in_output
            seq.text = seq.detokenizer.decode_all(ids[:-1] if cut else ids)
        elif decision.text_end is not None:
            seq.text = seq.text[: decision.text_end]
        else:
            seq.text += seq.detokenizer.flush()
        seq.finish_reason = decision.finish_reason
        seq.stop_reason = decision.stop_reason
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)

    def _make_output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.sequences:
            text = seq.text if seq.is_finished else seq.text[: seq.stop_checker.streamable_len(seq.text)]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
        )

    def stats(self) -> dict[str, int | float]:
        """Counters for the server's metrics."""
        sched, bm = self.scheduler, self.block_manager
        return {
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
