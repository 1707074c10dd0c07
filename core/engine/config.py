"""Engine settings as pydantic models; invalid values fail with a message naming the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.lora.config import LoRAConfig
from engine.speculative.config import SpeculativeConfig, parse_speculative_config

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: KV cache dtypes by name (each platform claims its own subset); ``float8_e4m3fn`` stores keys and values
#: unscaled (scale 1), halving the cache's bytes against bf16 (vLLM's ``--kv-cache-dtype fp8`` without
#: calibrated scales)
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_KV_CACHE_DTYPE_ALIASES = {
    "auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
}




class CacheConfig(BaseModel):
    """KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: explicit KV budget in bytes; wins over the fraction when set.
        memory_fraction: fraction of the device's free memory (after weights) given to the KV cache.
        kv_cache_dtype: cache dtype name (one of :data:`KV_CACHE_DTYPES`, or ``fp8`` / ``fp8_e4m3`` for
            ``float8_e4m3fn``); None or ``auto`` means the model dtype.
        num_blocks_override: exact number of blocks (tests use this to force preemption).
        enable_prefix_caching: reuse cached blocks of identical prompt prefixes.
    """

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    memory_fraction: float = Field(0.5, gt=0.0, le=1.0)
    kv_cache_dtype: str | None = None
    num_blocks_override: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_cache_dtype(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = _KV_CACHE_DTYPE_ALIASES.get(v, v)
        if v is not None and v not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype; choose auto, fp8 or one of {list(KV_CACHE_DTYPES)}")
        return v


class SchedulerConfig(BaseModel):
    """Continuous-batching limits.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks plus decodes).
        max_num_seqs: most sequences running at once.
        max_waiting_requests: most requests queued before new ones are refused (None: unbounded).
        preemption_mode: ``swap`` moves a preempted sequence's blocks to host memory and back, ``recompute``
            frees them and recomputes later, ``auto`` swaps where the platform's block cache can.
        priority_aging_steps: a waiting request gains one priority level per this many steps, so a
            stream of important requests cannot starve a less important one forever.
        scheduler_delay_factor: while sequences run, admit waiting ones only once the oldest has waited this
            many times as long as the last step that admitted prompts took, or once they fill the step's
            token budget (vLLM's delay factor): arrivals spread over several steps are then prefilled together
            instead of each making a step of its own longer; 0 admits them at once.
        async_scheduling: overlap the host's work (taking the last step's tokens, scheduling and building
            the next step) with the device running the current step, for steps whose rows all sample
            greedily on the device; the tokens are the same either way.
        target_step_time_ms: a service target for the step: at start-up the engine times steps of
            prompt tokens on this device and model and lowers ``max_num_batched_tokens`` to the largest
            budget (powers of two up to it) whose step ran within this many milliseconds, so that running
            streams wait about that long at most for a token while prompts are prefilled (None: the
            budget as given).
    """

    model_config = ConfigDict(extra="forbid")

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_waiting_requests: int | None = Field(None, ge=1)
    priority_aging_steps: int = Field(100, ge=1)
    scheduler_delay_factor: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    preemption_mode: Literal["auto", "swap", "recompute"] = "auto"
    async_scheduling: bool = True
    target_step_time_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)


class ParallelConfig(BaseModel):
    """How the model is spread over devices and processes.

    Attributes:
        tensor_parallel_size: ranks each layer's heads and MLP columns are split across (one process and
            one device each; the driver process is rank 0).
        pipeline_parallel_size: stages the layers are split into, one process and device each (not
            together with tensor parallelism yet).
        pipeline_micro_batches: the groups each step's sequences are cut into so that the stages work on
            different groups at once (None: one per stage; 1: the stages take turns on the whole step).
        data_parallel_size: engine replicas, each a whole engine in its own process (with its own
            tensor- or pipeline-parallel ranks), behind one server; requests go to the replica that holds
            the longest part of their prompt in its prefix cache, else to the least loaded one.
        data_parallel_rank: which replica this engine is (set by the driver for each replica it starts):
            its ranks drive the host's devices from ``data_parallel_rank * world_size`` on.
        distributed_executor_backend: ``mp`` starts the ranks as local processes (``spawn``); ``ray`` as
            Ray actors in a placement group, on any host of the Ray cluster this host belongs to (a local
            one is started when there is none). None picks ``mp``. Data-parallel replicas are local
            processes, whose ranks use ``mp`` (``ray`` with replicas of several ranks is refused).
        enable_expert_parallel: a mixture of experts' experts are divided among the tensor-parallel ranks
            (each runs its own experts, whole, for every token; the ranks' outputs are summed) instead of
            every expert being split across them.
        enable_dbo: dual-batch overlap: a pure decode step of at least ``dbo_decode_token_threshold``
            sequences is cut into two nano-batches, and each layer's attention over one runs on the
            platform's second lane while the other's matrix products run (platforms that claim
            ``step_overlap``; refused elsewhere, and with tensor or pipeline parallelism). Steps with a
            prompt or adapter rows run whole. Off by default: with today's GPU kernels the two lanes run
            one after the other (BENCHMARKS.md, session 35).
        dbo_decode_token_threshold: the fewest sequences of a decode step that ``enable_dbo`` cuts in two
            (in smaller steps the weights' bytes outweigh the KV cache's: little to overlap).
    """

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    pipeline_micro_batches: int | None = Field(None, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    data_parallel_rank: int = Field(0, ge=0)
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = Field(256, ge=2)

    @property
    def world_size(self) -> int:
        """The ranks of one engine (one replica): tensor-parallel times pipeline-parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def micro_batches(self) -> int:
        """The micro-batches of a pipeline-parallel step (1 without pipeline parallelism)."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    @property
    def first_local_device(self) -> int:
        """The host device index this engine's rank 0 drives (its replica's first)."""
        return self.data_parallel_rank * self.world_size


#: ``quantization`` names other engines give the same checkpoints -> this engine's method: vLLM's Marlin-kernel
#: variants of GPTQ and AWQ, and its MoE method for GPTQ / AWQ experts (the checkpoint says which)
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "moe_wna16": "auto"}


class EngineConfig(BaseModel):
    """Top-level engine settings.

    Attributes:
        model: a Hugging Face folder, a ``.gguf`` file, or None for the embedded default model.
        device: ``auto`` or a device / plugin name.
        dtype: model dtype name, or ``auto`` (the platform's preferred one).
        max_model_len: context limit; None means the model's own.
        seed: global seed for unseeded sampling.
        load_format: ``auto`` or ``dummy`` (random weights of the model's config, for benchmarks).
        tokenizer: tokenizer folder when it differs from the model's.
        enforce_eager: never use graph capture.
        quantization: ``auto`` keeps a checkpoint's quantized matrices (GGUF; GPTQ, AWQ, compressed-tensors
            and FP8 folders, read from their ``quantization_config``) quantized where the platform's GEMM
            runs their scheme (``GemmBackend.supported_quant_schemes``) and dequantizes the others;
            ``gptq``, ``awq``, ``compressed-tensors`` and ``gguf`` do the same after checking that the
            checkpoint is of that method (``gguf``: a ``.gguf`` file; vLLM's ``gptq_marlin`` / ``awq_marlin`` /
            ``moe_wna16`` are taken as ``gptq`` / ``awq`` / ``auto``); ``none`` dequantises every
            weight to the model dtype at load time; ``fp8`` quantizes a float checkpoint's layer projections
            to FP8 e4m3 with a scale per output channel as it loads, and their activations to FP8 per token
            (W8A8: about twice the matmul rate of bf16 on GPUs with FP8 units, at some accuracy; the
            embedding and the lm_head stay in the model dtype). It needs a GEMM that runs ``fp8_e4m3``.
        generation_config: ``auto`` takes the sampling defaults (temperature, top_p, top_k, min_p,
            repetition_penalty) of the checkpoint's ``generation_config.json`` for the fields a request
            leaves unset; ``none`` uses the engine's own defaults (``SamplingParams``').
        runner: ``generate`` takes generation requests only, ``pooling`` pooling requests only
            (embeddings, classification, scores); ``auto`` takes what the model serves (an embedding or
            classification checkpoint pools only, a causal LM does both).
        speculative_config: speculative decoding, with the leading engine's keys (``{"method": "ngram",
            "num_speculative_tokens": 4, "prompt_lookup_max": 4}``, or ``{"method": "suffix"}`` with its
            ``suffix_decoding_*`` keys); None: off.
        lora: multi-LoRA serving (``enable_lora``): device slots and the largest rank; None: off.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=1)
    seed: int = 0
    load_format: str = "auto"
    tokenizer: str | None = None
    enforce_eager: bool = False
    quantization: Literal["auto", "none", "fp8", "gptq", "awq", "compressed-tensors", "gguf"] = "auto"
    generation_config: Literal["auto", "none"] = "auto"
    runner: Literal["auto", "generate", "pooling"] = "auto"
    speculative_config: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    def to_process_json(self) -> str:
        """This configuration as JSON for another process of the engine (the engine core, a replica, a rank).

        Fields left at their defaults stay unset on the other side, so that it applies the same platform
        defaults (``max_num_batched_tokens`` depends on the device when not given): a plain
        ``model_dump_json`` would set every field there.
        """
        return self.model_dump_json(exclude_unset=True)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _check_speculative(cls, v: object) -> object:
        return parse_speculative_config(v)  # type: ignore[arg-type]

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization_alias(cls, v: object) -> object:
        # vLLM's kernel-named methods: the same checkpoints, which this engine runs through its own kernels
        return QUANTIZATION_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
        v = aliases.get(v, v)
        if v not in SUPPORTED_DTYPES:
            raise ValueError(f"unknown dtype {v!r}; choose one of {list(SUPPORTED_DTYPES)}")
        return v

    @field_validator("load_format")
    @classmethod
    def _check_load_format(cls, v: str) -> str:
        if v not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {v!r}; choose 'auto' or 'dummy'")
        return v
