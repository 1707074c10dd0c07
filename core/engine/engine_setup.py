"""Engine set-up: from a configuration and a platform to a loaded model, a KV pool, a scheduler and a runner.

Runs once, before any request: checks the configuration against the platform and the model, loads the
tokenizer and the weights, sizes the KV pool from its memory budget, captures decode graphs and warms
the platform's kernels up. :func:`build_engine_parts` returns everything the engine then holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.hybrid_block_manager import HybridBlockManager
from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache
from engine.interfaces.communicator import Communicator
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.model_runner import PlatformModelRunner
from engine.interfaces.ops import OpTable, reference_ops
from engine.interfaces.platform import Platform
from engine.kv_groups import KVGroupLayout, plan_kv_groups
from engine.kv_pool import longest_fitting_len, make_kv_pool
from engine.loader import dummy_weights, iter_weights, load_model_config, load_tokenizer, resolve_model_path
from engine.loader.fp8 import FP8_E4M3_SCHEME, quantize_fp8_per_channel
from engine.loader.paths import default_served_name, is_gguf_file
from engine.loader.prequantized.config import PRE_QUANTIZED_METHODS
from engine.lora.manager import LoraManager
from engine.lora.setup import attach_lora, lora_config_problems
from engine.model_runner import ModelRunner
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.layers.nano_batches import attach_step_overlap
from engine.models.registry import ModelRegistry
from engine.parallel.pipeline_parallel import PipelineStage, stage_layers
from engine.parallel.rank_workers import RankWorkers, start_rank_workers
from engine.parallel.tensor_parallel import TensorParallel
from engine.phases import timed_phase
from engine.plugins.manager import PluginManager
from engine.sampling.sampler import Sampler
from engine.scheduler import Scheduler
from engine.speculative.draft_model import DraftParts
from engine.speculative.eagle import EagleParts
from engine.speculative.proposer_setup import LoadedProposer, finish_proposer, load_proposer
from engine.start_up_graphs import capture_and_warm_up
from engine.step_time_budget import with_fitted_step_budget

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineParts:
    """What set-up builds and the engine holds.

    Attributes:
        config: the configuration, its ``dtype`` resolved (never ``"auto"``).
        platform: the platform everything runs on.
        model_path: the resolved model folder or GGUF file.
        model_name: the name the model is served under by default.
        model_config: the model's architecture settings.
        dtype: the model's torch dtype.
        device: the torch device inputs go to.
        tokenizer: the model's tokenizer.
        eos_token_ids: the model's and the tokenizer's end-of-sequence ids, without repeats.
        model: the loaded model (or the platform's own runner).
        block_cache: the platform's KV pool.
        block_manager: the block tables and prefix cache over that pool.
        max_model_len: the context limit, capped by what the pool can hold.
        scheduler: chooses each step's work.
        sampler: turns logits into tokens.
        runner: runs steps of the model (with decode graphs when captured).
        num_blocks: KV blocks in the pool.
        workers: the other tensor-parallel ranks' processes (None: one process).
        lora: the adapters and their device slots (None: LoRA off).
        draft: the draft model, EAGLE head or MTP layer of speculative decoding (None: none).
    """

    config: EngineConfig
    platform: Platform
    model_path: str
    model_name: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    tokenizer: Any
    eos_token_ids: list[int]
    model: Any
    block_cache: BlockCache
    block_manager: BlockManager | HybridBlockManager
    max_model_len: int
    scheduler: Scheduler
    sampler: Sampler
    runner: ModelRunner
    num_blocks: int
    workers: RankWorkers | None = None
    lora: LoraManager | None = None
    draft: DraftParts | EagleParts | None = None


def build_engine_parts(config: EngineConfig, platform: Platform, plugin_manager: PluginManager) -> EngineParts:
    """Check the configuration, load the model, size the KV pool, and build the scheduler and runner.

    Args:
        config: the engine configuration (``dtype`` may be ``"auto"``: the platform's first).
        platform: the selected platform.
        plugin_manager: supplies the plugins' extra model architectures.

    Returns:
        The engine's parts, decode graphs captured and kernels warmed up where the platform asks for it.

    Raises:
        EngineConfigError: the configuration cannot run here (every reason listed), or a full step does
            not fit beside the KV cache.
        engine.loader.errors.ModelLoadError: the model cannot be found, read or is not supported.
    """
    config, model_path, model_config, model_class, registry = resolve_model(config, platform, plugin_manager)
    # rank 0 of this engine (of its data-parallel replica) drives the replica's first device
    first_device = config.parallel.first_local_device
    try:
        platform.use_device(first_device)
    except RuntimeError as exc:
        raise EngineConfigError(str(exc)) from None
    dtype = _DTYPES[config.dtype]
    device = platform.torch_device()
    with timed_phase(f"loading the tokenizer of {config.tokenizer or model_path}", "loaded the tokenizer"):
        tokenizer = load_tokenizer(config.tokenizer or model_path)
    if tokenizer.files_dir is not None:
        logger.info("tokenizer files (for tools that load a tokenizer from a folder): %s", tokenizer.files_dir)
    eos_token_ids = list(dict.fromkeys(model_config.eos_token_ids + tokenizer.eos_token_ids))

    workers: RankWorkers | None = None
    world = config.parallel.world_size
    if world > 1:
        parallel_config = config.parallel
        problems = model_class.parallel_problems(
            model_config, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size,
            parallel_config.enable_expert_parallel,
        )  # fmt: skip
        if problems:
            raise EngineConfigError("; ".join(problems))
        # ranks 1.. in their own processes; this one is rank 0 (the scheduler and the sampler live here)
        workers = start_rank_workers(config, world, platform.ray_device_resource)
    try:
        parallel = None
        if workers is not None:
            comm = platform.make_communicator(world, 0, workers.init_method, local_rank=first_device)
            workers.communicators.append(comm)
            parallel = rank_parallelism(config, model_config, 0, comm)
        model, attention, ops = build_model(
            config, platform, registry, model_path, model_config, model_class, *(parallel or (None, None))
        )
        # a draft model's, EAGLE head's or MTP layer's weights before the pools are sized
        draft = load_proposer(config, platform, registry, model, model_config)
        parts = _finish_parts(config, platform, model_path, model_config, dtype, device, tokenizer, eos_token_ids,
                              model, attention, ops, workers, draft)  # fmt: skip
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return parts


#: the step budget of encoder-only models (embeddings, cross-encoders) unless the user or the platform
#: gives one (``Platform.default_encoder_step_tokens``)
ENCODER_STEP_TOKENS = 32768


def with_step_budget(
    config: EngineConfig, platform: Platform, model_class: type[CausalLM], context_len: int | None = None
) -> EngineConfig:
    """``config`` with the step token budget filled in where the user set none.

    An encoder's step is one forward over whole prompts and nothing decodes: on a GPU a larger step only
    spreads the per-step host work over more texts (H200, bge-large, 128-token texts: 64 a step ran at
    0.99x sentence-transformers, 256 a step at 1.69x), on a CPU a smaller one keeps its activations in
    cache; so it takes the platform's encoder budget, else the core's, and at least ``context_len``. Other
    models take the platform's budget, if it has one.
    """
    if "max_num_batched_tokens" in config.scheduler.model_fields_set:
        return config
    if getattr(model_class, "needs_whole_prompt", False):
        # at least the context: a step must hold any prompt the model takes
        budget: int | None = max(platform.default_encoder_step_tokens() or ENCODER_STEP_TOKENS, context_len or 0)
    else:
        budget = platform.default_max_num_batched_tokens()
    if budget is None:
        return config
    scheduler = config.scheduler.model_copy(update={"max_num_batched_tokens": budget})
    return config.model_copy(update={"scheduler": scheduler})


def resolve_model(
    config: EngineConfig, platform: Platform, plugin_manager: PluginManager
) -> tuple[EngineConfig, str, ModelConfig, type[CausalLM], ModelRegistry]:
    """Find the model and its architecture, resolve ``dtype``, and check that it all runs here.

    Returns:
        ``(config with its dtype resolved, model path, model config, model class, registry)``; with
        several ranks the config also schedules synchronously, and runs eagerly unless the platform's
        graphs hold collectives (``Capabilities.graph_capture_collectives``) and no pipeline is split.

    Raises:
        EngineConfigError: the configuration cannot run here (every reason listed).
    """
    model_path = resolve_model_path(config.model)
    # the core's architectures plus the plugins' (engine_register_models); every loader path resolves through it
    registry = ModelRegistry.from_plugins(plugin_manager)
    model_config = load_model_config(
        model_path, check_weights=config.load_format != "dummy", registry=registry
    )
    model_class = registry.resolve(model_config.architecture, model_path)
    dtype_name = config.dtype if config.dtype != "auto" else platform.capabilities().dtypes[0]
    config = config.model_copy(update={"dtype": dtype_name})
    config = with_step_budget(config, platform, model_class, config.max_model_len or model_config.max_position_embeddings)
    _check_config(config, platform, model_config, model_class, is_gguf_file(model_path))
    parallel = config.parallel
    if parallel.world_size > 1:
        if config.scheduler.target_step_time_ms is not None:
            # checked before the weights load: the timing steps would have to run on every rank
            raise EngineConfigError("--target-step-time-ms is not supported with tensor or pipeline parallelism yet")
        if not platform.capabilities().distributed:
            raise EngineConfigError(
                f"{parallel.world_size} ranks (tensor/pipeline parallelism) need collectives, which "
                f"{platform.name} does not claim (Capabilities.distributed)"
            )
        # Every rank records and replays decode graphs in lockstep (engine.parallel.rank_graphs) where the
        # platform's graphs can hold its collectives. Pipeline stages stay eager: a stage's graph would hold
        # its sends to the next stage and its receives from the one before, which pair only if every stage
        # recorded them in the same micro-batch schedule; that is not recorded yet. No step is left in
        # flight: the other ranks take their inputs from the host.
        eager = (
            config.enforce_eager or parallel.pipeline_parallel_size > 1
            or not platform.capabilities().graph_capture_collectives
        )  # fmt: skip
        scheduler = config.scheduler.model_copy(update={"async_scheduling": False})
        config = config.model_copy(update={"enforce_eager": eager, "scheduler": scheduler})
    return config, model_path, model_config, model_class, registry


def rank_parallelism(
    config: EngineConfig, model_config: ModelConfig, rank: int, comm: Communicator
) -> tuple[TensorParallel | None, PipelineStage | None]:
    """Rank ``rank``'s place: its tensor-parallel group and its pipeline stage, either or both.

    With both, rank ``r`` is tensor-parallel rank ``r % tp`` of stage ``r // tp``: the ranks of a stage
    split its layers' heads, and each hands its activations to the rank of the same place in the next
    stage. Every rank splits the world communicator the same way, in the same order.

    Raises:
        EngineConfigError: both are asked for and the platform's communicator does not split.
    """
    parallel = config.parallel
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp_size == 1:
        return TensorParallel(rank, tp_size, comm, parallel.enable_expert_parallel), None
    layers = stage_layers(model_config.num_layers, pp_size, rank // tp_size)
    if tp_size == 1:
        return None, PipelineStage(rank, pp_size, comm, layers)
    try:
        tp_comm = comm.split([[s * tp_size + t for t in range(tp_size)] for s in range(pp_size)])
        pp_comm = comm.split([[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)])
    except NotImplementedError as exc:
        raise EngineConfigError(f"tensor and pipeline parallelism together need sub-groups: {exc}") from None
    return TensorParallel(rank % tp_size, tp_size, tp_comm, parallel.enable_expert_parallel), PipelineStage(rank // tp_size, pp_size, pp_comm, layers)


def build_model(
    config: EngineConfig,
    platform: Platform,
    registry: ModelRegistry,
    model_path: str,
    model_config: ModelConfig,
    model_class: type[CausalLM],
    tp: TensorParallel | None = None,
    pp: PipelineStage | None = None,
) -> tuple[Any, AttentionBackend, OpTable]:
    """Build the model on the platform's backends and load its weights (this rank's slices under ``tp``,
    this stage's layers under ``pp``).

    Returns:
        ``(model, attention backend, op table)``.

    Raises:
        EngineConfigError: the model cannot be split as ``tp`` asks.
    """
    dtype, device = _DTYPES[config.dtype], platform.torch_device()
    attention = platform.make_attention_backend()
    gemm = platform.make_gemm_backend()
    ops = reference_ops().with_overrides(platform.op_overrides())
    # a platform may run the whole forward itself (JAX); otherwise the core's torch model runs on its backends
    model = platform.make_model_runner(model_config, config.dtype) or model_class(
        model_config, ops, attention, gemm, dtype, device
    )
    for split, method, kind in ((tp, "use_tensor_parallel", "tensor"), (pp, "use_pipeline_parallel", "pipeline")):
        if split is None:
            continue
        if not hasattr(model, method):
            raise EngineConfigError(f"{model_config.architecture} does not run {kind}-parallel on {platform.name}")
        try:
            getattr(model, method)(split)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
    if config.quantization == "fp8":
        model.linear_quantizer = _fp8_quantizer(platform.name, gemm, model)
    # quantized matrices stay quantized only for the schemes this platform's GEMM runs itself (a
    # tensor-parallel rank's slices too, where they fall on the scheme's blocks)
    keep_quantized = gemm.supported_quant_schemes if config.quantization != "none" else frozenset()
    weights = (
        dummy_weights(model_config, seed=config.seed, dtype=dtype, device=device, registry=registry)
        if config.load_format == "dummy"
        # a tensor-parallel rank reads only its slices from safetensors files, a pipeline stage its layers
        else iter_weights(
            model_path, model_config, keep_quantized=keep_quantized, registry=registry,
            lazy=tp is not None or pp is not None,
        )  # fmt: skip
    )
    free_before = platform.free_memory_bytes()
    with timed_phase(f"loading the weights of {model_path}", "loaded the weights"):
        model.load_weights(weights)
    platform.synchronize()
    # what the KV cache sizing sees next: packed weights leave it the memory they save
    logger.info(
        "the weights take %.2f GiB of %s memory", max(free_before - platform.free_memory_bytes(), 0) / 2**30, platform.name
    )
    return model, attention, ops


def _finish_parts(
    config: EngineConfig,
    platform: Platform,
    model_path: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: Any,
    eos_token_ids: list[int],
    model: Any,
    attention: AttentionBackend,
    ops: OpTable,
    workers: RankWorkers | None,
    draft: LoadedProposer | None = None,
) -> EngineParts:
    lora = attach_lora(config, model)
    if config.parallel.enable_dbo:
        attach_step_overlap(platform, model, config.parallel.dbo_decode_token_threshold)
    layout = kv_group_layout(model)
    windows = layout.windows if layout is not None else [model_config.sliding_window]
    block_cache, num_blocks = make_kv_pool(
        config, platform, model_config, attention, layout, model, draft.bytes_per_block if draft is not None else 0
    )
    if workers is not None:
        workers.start_pools(num_blocks)
    block_manager: BlockManager | HybridBlockManager
    if layout is None:
        block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, windows[0])
    else:
        block_manager = HybridBlockManager(num_blocks, config.cache.block_size, windows, config.cache.enable_prefix_caching)
    # a sequence must fit the pool alone; under a window it needs only its window's blocks
    max_model_len = longest_fitting_len(
        config, windows, config.max_model_len or model_config.max_position_embeddings, block_manager.num_total_blocks
    )
    sampler = Sampler(eos_token_ids, model_config.vocab_size, ops.greedy_pick)
    runner = ModelRunner(
        model, block_cache, block_manager, sampler, device, model_config.sliding_window, ops.apply_token_bitmask
    )
    if workers is not None:
        runner.mirror = workers.mirror
    runner.micro_batches = config.parallel.micro_batches
    runner.lora = lora
    if layout is not None:
        runner.use_kv_groups(layout)
        logger.info(
            "KV cache: %d groups of %d layers (windows %s); sliding groups release blocks out of their window",
            len(layout.groups), layout.slots, ", ".join(str(w or "global") for w in windows),
        )
    if not isinstance(model, PlatformModelRunner):
        capture_and_warm_up(config, platform, model_config, runner, max_model_len, workers)
    if config.scheduler.target_step_time_ms is not None:
        if isinstance(model, PlatformModelRunner):
            raise EngineConfigError(
                f"--target-step-time-ms times steps on the core's model runner; {platform.name} runs its own"
            )
        with timed_phase("timing steps for the step-time target", "step budget chosen"):
            config = with_fitted_step_budget(config, runner, max_model_len)
    # a manager with a table per KV group never swaps: its sequences are recomputed
    scheduler = Scheduler(config.scheduler, block_manager, block_cache.num_host_blocks if layout is None else 0)
    return EngineParts(
        config=config,
        platform=platform,
        model_path=model_path,
        model_name=default_served_name(config.model, model_path),
        model_config=model_config,
        dtype=dtype,
        device=device,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        model=model,
        block_cache=block_cache,
        block_manager=block_manager,
        max_model_len=max_model_len,
        scheduler=scheduler,
        sampler=sampler,
        runner=runner,
        num_blocks=num_blocks,
        workers=workers,
        lora=lora,
        draft=finish_proposer(config, platform, draft, num_blocks, runner),
    )


def _check_config(
    config: EngineConfig, platform: Platform, model_config: ModelConfig, model_class: type[CausalLM] | None = None,
    gguf: bool = False,
) -> None:  # fmt: skip
    """Raise :class:`EngineConfigError` listing every reason the configuration cannot run here."""
    reasons = platform.validate(config)
    caps = platform.capabilities()
    head_sizes = caps.head_sizes
    if model_class is not None:
        for feature, description in model_class.required_features(model_config).items():
            if not getattr(caps, feature, False):
                reasons.append(f"{model_config.architecture} needs {description}, which {platform.name} does not support")
    reasons += lora_config_problems(config, platform, model_class)
    if config.parallel.enable_dbo:
        if not caps.step_overlap:
            reasons.append(f"enable_dbo overlaps a step's attention with its products on two lanes, which {platform.name} does not run (it does not claim step_overlap)")
        if config.parallel.world_size > 1:
            reasons.append("enable_dbo runs on one rank: it does not combine with tensor or pipeline parallelism yet")
    method = config.quantization
    if method in PRE_QUANTIZED_METHODS:
        found = model_config.hf_config.get("quantization_config") or {}
        if found.get("quant_method") != method:
            reasons.append(f"quantization {method!r} needs a {method} checkpoint; this one is {found.get('quant_method') or 'not quantized'}")
    if method == "gguf" and not gguf:
        reasons.append("quantization 'gguf' needs a .gguf model file; this one is a folder")
    if model_config.head_dim not in head_sizes:
        reasons.append(f"head size {model_config.head_dim} is not supported on {platform.name} (supported: {list(head_sizes)})")
    model_max = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
        reasons.append(f"max_model_len {config.max_model_len} exceeds the model's context length {model_max}")
    if reasons:
        raise EngineConfigError("; ".join(reasons))


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


def kv_group_layout(model: object) -> KVGroupLayout | None:
    """The KV groups of a core model that mixes windows across layers (None: one table per sequence)."""
    if isinstance(model, PlatformModelRunner) or not getattr(type(model), "supports_kv_groups", False):
        return None
    windows = getattr(model, "layer_windows", None)
    return plan_kv_groups(windows) if windows else None


__all__ = ["EngineConfigError", "EngineParts", "build_engine_parts"]
