"""The offline Python API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchParams
from engine.chat_input import encode_conversation
from engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from engine.engine_factory import create_engine
from engine.lora import LoRAConfig, LoRARequest
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams

_CACHE_KEYS = set(CacheConfig.model_fields)
_SCHED_KEYS = set(SchedulerConfig.model_fields)
_PARALLEL_KEYS = set(ParallelConfig.model_fields)
_LORA_KEYS = set(LoRAConfig.model_fields)


#: ``LLM(task=...)`` values that mean ``runner="pooling"``
_POOLING_TASKS = frozenset({"embed", "classify", "score", "reward", "encode"})


class LLM:
    """Generate text offline, batching every prompt through the engine.

    Args:
        model: a Hugging Face folder or a ``.gguf`` file; None for the embedded default model.
        device: ``"auto"`` (best available plugin) or a device name such as ``"cpu"`` or ``"cuda"``.
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: seed of unseeded sampling.
        max_model_len: context limit (default: the model's).
        generation_config: ``"auto"`` uses the sampling defaults of the checkpoint's
            ``generation_config.json`` (temperature, top_p, top_k, min_p, repetition_penalty) for calls
            that pass no ``sampling_params`` (see :meth:`get_default_sampling_params`); ``"none"``: the
            engine's own ``SamplingParams()``.
        **kwargs: any :class:`EngineConfig` field, or a cache / scheduler field such as ``block_size``,
            ``kv_cache_memory_bytes``, ``num_blocks_override``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``target_step_time_ms``;
            ``enable_lora=True`` with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras`` serves LoRA
            adapters (``generate(..., lora_request=LoRARequest(...))``).

    Raises:
        ValueError: for unknown keyword arguments or invalid settings (pydantic's message).
    """

    #: prompts are queued in chunks of at least this many (and of at least ``max_num_seqs``)
    QUEUE_CHUNK: ClassVar[int] = 256

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        generation_config: str = "auto",
        **kwargs: Any,
    ) -> None:
        task = kwargs.pop("task", None)
        if task is not None:
            # the leading engine's older spelling of the runner
            if task not in _POOLING_TASKS and task != "generate":
                raise ValueError(f"task must be 'generate' or one of {sorted(_POOLING_TASKS)}, got {task!r}")
            kwargs.setdefault("runner", "generate" if task == "generate" else "pooling")
        cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_KEYS}
        sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED_KEYS}
        parallel = {k: kwargs.pop(k) for k in list(kwargs) if k in _PARALLEL_KEYS}
        lora = {k: kwargs.pop(k) for k in list(kwargs) if k in _LORA_KEYS}
        if kwargs.pop("enable_lora", False):
            kwargs["lora"] = LoRAConfig(**lora)
        elif lora:
            raise ValueError(f"{', '.join(sorted(lora))} need enable_lora=True")
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            generation_config=generation_config,
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**sched),
            parallel=ParallelConfig(**parallel),
            **kwargs,
        )
        #: the engine: an ``LLMEngine``, or a ``DataParallelEngine`` for ``data_parallel_size > 1``
        self.llm_engine = create_engine(config)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor, pipeline and data parallelism) and threads; safe to call
        twice."""
        self.llm_engine.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The settings a call without ``sampling_params`` uses.

        Returns:
            ``SamplingParams()`` with the checkpoint's ``generation_config.json`` defaults (temperature,
            top_p, top_k, min_p, repetition_penalty) in place of the engine's where the model has them and
            ``generation_config="auto"``. Explicit ``SamplingParams`` passed to :meth:`generate` or
            :meth:`chat` are used as they are: start from this method's result
            (``llm.get_default_sampling_params().model_copy(update={"max_tokens": 64})``) to keep the
            model's defaults and change some fields.
        """
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts: str | list[int] | dict[str, Any] | Seq[str | list[int] | dict[str, Any]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in prompt order.

        Args:
            prompts: one prompt or a list; each a string, a list of token ids, ``{"prompt": text}`` or
                ``{"prompt_token_ids": ids}``.
            sampling_params: one for all prompts, or one per prompt; default
                :meth:`get_default_sampling_params` (the checkpoint's generation defaults).
            use_tqdm: show a progress bar.
            priority: per prompt, lower runs first (default all 0: first come, first served).
            cache_salt: the prompts share cached prefix blocks only with requests of the same salt
                (default None: with every unsalted request).
            lora_request: the LoRA adapter every prompt runs under, or one per prompt (None entries: the
                base model); needs ``enable_lora=True``. An adapter is loaded on first use.

        Raises:
            InvalidRequestError: for a bad prompt, settings or adapter; raised before any prompt runs.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [_unwrap_prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        return self._run(prompts, params_list, use_tqdm, priorities, cache_salt, loras)

    def embed(
        self,
        prompts: str | list[int] | dict[str, Any] | Seq[str | list[int] | dict[str, Any]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Embed each prompt: its final hidden states pooled (the model's pooling, or ``pooling_params``');
        outputs in prompt order, each vector at ``outputs.embedding``.

        Args:
            prompts: as for :meth:`generate`.
            pooling_params: pooling type, normalization and Matryoshka ``dimensions`` (default: the model's
                sentence-transformers config, else the last token's state, normalized).
            use_tqdm: show a progress bar.
            lora_request: the LoRA adapter the prompts run under, or one per prompt (``enable_lora``).

        Raises:
            engine.errors.InvalidRequestError: a bad prompt, or ``dimensions`` past the model's width.
        """
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
        items = [prompts] if single else list(prompts)
        params = pooling_params or PoolingParams()
        loras = _per_prompt(lora_request, len(items))
        return self._run([_unwrap_prompt(p) for p in items], [params] * len(items), use_tqdm, loras=loras)  # type: ignore[list-item,return-value]

    def encode(
        self,
        prompts: str | list[int] | dict[str, Any] | Seq[str | list[int] | dict[str, Any]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """The pooled hidden states of each prompt, as :meth:`embed` (``outputs.data`` is the tensor)."""
        return self.embed(prompts, pooling_params, use_tqdm)

    def classify(
        self, prompts: str | list[int] | Seq[str | list[int]], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Run a sequence-classification model's head: ``outputs.probs`` per prompt (softmax over the
        labels, a sigmoid for a single label), in prompt order.

        Raises:
            engine.errors.InvalidRequestError: the model has no classification head, or a bad prompt.
        """
        return self.embed(prompts, PoolingParams(task="classify"), use_tqdm)  # type: ignore[arg-type]

    def reward(
        self, prompts: str | list[int] | Seq[str | list[int]], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """A reward model's raw scores (the head's logits, no activation), in prompt order."""
        return self.embed(prompts, PoolingParams(task="classify", activation=False), use_tqdm)  # type: ignore[arg-type]

    def score(self, text_1: str | Seq[str], text_2: str | Seq[str], use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Score text pairs with a cross-encoder (a reranker): one ``text_1`` against each ``text_2``, or
        pairwise for equal-length lists; each pair is tokenized as the model's tokenizer joins two texts,
        and ``outputs.score`` is the head's probability (a sigmoid for a single label).

        Raises:
            ValueError: lists of different lengths (other than one ``text_1``).
        """
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 or as many as text_2")
        pairs = [self.tokenizer.encode_pair(a, b) for a, b in zip(firsts, seconds)]
        return self.embed(pairs, PoolingParams(task="classify"), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        allow_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a batch of them, using the model's chat template.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them.
            sampling_params: one for all conversations, or one per conversation; default
                :meth:`get_default_sampling_params`.
            use_tqdm: show a progress bar.
            add_generation_prompt: end the rendered prompt with the assistant's turn.
            cache_salt: see :meth:`generate`.
            allow_special_tokens: read special-token strings in message text (``<|im_end|>``) as special
                tokens; by default they stay plain text, as the server keeps them
                (``engine.chat_input.encode_conversation``).
            tools: OpenAI function tools (``{"type": "function", "function": {...}}``) for every
                conversation, rendered by the template or, if it has no tool support, in the Hermes
                format (``engine.chat_tools``); the outputs are text, to be parsed with a tool parser
                (``engine.tool_parsers``) if wanted.
            chat_template_kwargs: extra template variables, such as ``{"enable_thinking": False}``.
            lora_request: see :meth:`generate`.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        token_prompts = [
            encode_conversation(
                self.tokenizer, c, add_generation_prompt, allow_special_tokens,
                tools=tools, template_kwargs=chat_template_kwargs,
            )  # fmt: skip
            for c in conversations
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm, cache_salt=cache_salt, lora_request=lora_request)

    def beam_search(
        self, prompts: str | list[int] | Seq[str] | Seq[list[int]], params: BeamSearchParams | None = None,
        use_tqdm: bool = False, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search for each prompt (strings or token ids); each output's completions are the
        ``beam_width`` best hypotheses, best first; ``lora_request`` as for :meth:`generate`."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        loras = _per_prompt(lora_request, len(prompts))
        return self._run(prompts, [params or BeamSearchParams()] * len(prompts), use_tqdm, loras=loras)

    def _run(
        self,
        prompts: list[Any],
        params_list: list[SamplingParams] | list[BeamSearchParams],
        use_tqdm: bool,
        priorities: list[int] | None = None,
        cache_salt: str | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        for lora in set(loras or []) - {None}:  # a broken adapter fails the call before any prompt runs
            engine.add_lora(lora)
        count = len(prompts)
        rows = list(zip(prompts, params_list, priorities or [0] * count, loras or [None] * count))
        # Prompts are tokenized (one batch per chunk, on a worker thread: the Rust tokenizer releases the
        # GIL) and queued a chunk at a time while the device runs the steps already launched: tokenizing
        # thousands of texts up front would leave the device idle meanwhile (H200, 4,096 embedding texts:
        # 190 ms of a 700 ms run). The first chunk is checked before anything runs; a bad prompt in a later
        # one fails the call too, and every request already queued is aborted.
        chunk = max(self.QUEUE_CHUNK, engine.config.scheduler.max_num_seqs)
        chunks = [rows[i : i + chunk] for i in range(0, count, chunk)]
        ids: list[str] = []
        # the objects that exist now (modules, weights, the engine) are left out of the collector's full
        # passes during the run: with them a pass took 300 ms in a 4,096-text embedding run (a caller
        # that froze objects itself keeps its own arrangement)
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            # one chunk has nothing to overlap with: it is tokenized here (a worker thread started per call
            # cost about 1 ms, a batch-1 call's whole host overhead on a GPU being a few)
            worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") if len(chunks) > 1 else None
            with worker or contextlib.nullcontext():

                def tokenize(index: int) -> Future[list[list[int]]] | None:
                    if index >= len(chunks):
                        return None
                    prompts = [r[0] for r in chunks[index]]
                    if worker is not None:
                        return worker.submit(engine.tokenize_prompts, prompts)
                    done: Future[list[list[int]]] = Future()
                    done.set_result(engine.tokenize_prompts(prompts))
                    return done

                pending = tokenize(0)
                results: dict[str, RequestOutput] = {}
                bar = tqdm(total=count, desc="Generating", disable=not use_tqdm)
                for index in range(len(chunks)):
                    assert pending is not None
                    tokens = pending.result()
                    pending = tokenize(index + 1)
                    self._queue(chunks[index], tokens, cache_salt, ids)
                    if index + 1 < len(chunks):
                        self._collect(engine.step(), results, bar)
                while len(results) < count:
                    self._collect(engine.step(), results, bar)
                bar.close()
        except BaseException:
            engine.abort_request(ids)  # leave no request (and no KV block) behind on an error or Ctrl-C
            raise
        finally:
            if freeze:
                gc.unfreeze()
        return [results[rid] for rid in ids]

    def _queue(
        self, rows: list[tuple[Any, Any, int, LoRARequest | None]], token_ids: list[list[int]], cache_salt: str | None,
        ids: list[str],
    ) -> None:
        """Add ``rows`` (prompt, params, priority, adapter) to the engine, a text prompt with its
        ``token_ids`` (:meth:`LLMEngine.tokenize_prompts`), appending their request ids to ``ids``.

        Raises:
            engine.errors.InvalidRequestError: the first bad prompt (the rows before it are queued).
        """
        engine = self.llm_engine
        for (prompt, params, prio, lora), tokens in zip(rows, token_ids, strict=True):
            rid = f"offline-{next(self._counter)}"
            # only when given: a data-parallel engine (which refuses LoRA at start-up) takes no adapter
            extra: dict[str, Any] = {"lora_request": lora} if lora is not None else {}
            if isinstance(prompt, str):
                extra["prompt_token_ids"] = tokens
            engine.add_request(rid, prompt, params, priority=prio, final_only=True, cache_salt=cache_salt, **extra)
            ids.append(rid)

    @staticmethod
    def _collect(outputs: list[RequestOutput], results: dict[str, RequestOutput], bar: Any) -> None:
        for out in outputs:
            if out.finished:
                results[out.request_id] = out
                bar.update(1)


def _per_prompt(lora: LoRARequest | Seq[LoRARequest | None] | None, count: int) -> list[LoRARequest | None] | None:
    """``lora_request`` as one entry per prompt (None: no prompt has an adapter).

    Raises:
        ValueError: a list whose length is not the number of prompts.
    """
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras


def _unwrap_prompt(prompt: Any) -> Any:
    """A ``{"prompt": ...}`` or ``{"prompt_token_ids": ...}`` dict as its text or ids; others unchanged.

    Raises:
        ValueError: a dict with another shape (a key this engine does not take is named).
    """
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompt dicts take 'prompt' or 'prompt_token_ids'; unsupported key(s): {', '.join(unknown)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    return prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
