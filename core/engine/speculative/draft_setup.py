"""Loading the draft model of ``speculative_config={"model": ...}``: checked against the target, its
weights loaded before the KV pools are sized (so the target's pool leaves the draft's room), then a pool
of as many blocks as the target's, since each mirrored sequence holds as many tokens as its target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.interfaces.block_cache import KVCacheSpec
from engine.interfaces.model_runner import PlatformModelRunner
from engine.interfaces.ops import OpTable
from engine.interfaces.platform import Platform
from engine.kv_pool import kv_cache_spec
from engine.loader import load_model_config, resolve_model_path
from engine.loader.errors import ModelLoadError
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.registry import ModelRegistry
from engine.sampling.sampler import Sampler
from engine.speculative.draft_model import DraftParts


@dataclass(slots=True)
class LoadedDraft:
    """A draft model with its weights loaded, its KV pool not made yet."""

    model: Any
    ops: OpTable
    attention: Any
    model_config: ModelConfig
    model_path: str
    spec: KVCacheSpec
    bytes_per_block: int


def wants_draft(config: EngineConfig) -> bool:
    """Whether the configuration speculates with a draft model."""
    spec = config.speculative_config
    return spec is not None and spec.method == "draft_model"


def load_draft(
    config: EngineConfig, platform: Platform, registry: ModelRegistry, target: ModelConfig
) -> LoadedDraft:
    """Load the draft model on ``platform`` in the target's dtype.

    Raises:
        EngineConfigError: the draft cannot be read, or cannot propose for this target here (its
            vocabulary is larger, it mixes attention windows, or the target runs in pipeline stages).
    """
    from engine.engine_setup import build_model  # set-up imports this module: imported when called

    spec_config = config.speculative_config
    assert spec_config is not None and spec_config.model is not None
    # data-parallel replicas are whole engines: each runs a draft of its own; under tensor parallelism the
    # driver runs the whole draft beside its shard of the target
    if config.parallel.pipeline_parallel_size > 1:
        raise EngineConfigError("speculative decoding with a draft model runs on one rank; pipeline parallelism is not supported with it")
    try:
        path = resolve_model_path(spec_config.model)
        draft_config = load_model_config(path, check_weights=config.load_format != "dummy", registry=registry)
        model_class = registry.resolve(draft_config.architecture, path)
    except ModelLoadError as exc:
        raise EngineConfigError(f"speculative_config model: {exc}") from None
    problems = []
    if draft_config.vocab_size > target.vocab_size:
        problems.append(
            f"its vocabulary ({draft_config.vocab_size} tokens) is larger than the target's ({target.vocab_size}); "
            "the draft must share the target's tokenizer"
        )
    if draft_config.head_dim not in platform.capabilities().head_sizes:
        problems.append(f"its head size {draft_config.head_dim} is not supported on {platform.name}")
    if problems:
        raise EngineConfigError(f"speculative_config model {spec_config.model}: " + "; ".join(problems))
    draft_run = config.model_copy(update={"model": path, "quantization": "auto"})
    model, attention, ops = build_model(draft_run, platform, registry, path, draft_config, model_class)
    if isinstance(model, PlatformModelRunner) or len(set(getattr(model, "layer_windows", None) or [None])) > 1:
        raise EngineConfigError(
            f"speculative_config model {spec_config.model}: a draft runs on the core's models with one attention window for every layer"
        )
    kv = kv_cache_spec(config, draft_config)
    return LoadedDraft(model, ops, attention, draft_config, path, kv, kv.bytes_per_block(platform.element_size(kv.dtype)))


def finish_draft(config: EngineConfig, platform: Platform, draft: LoadedDraft, num_blocks: int) -> DraftParts:
    """The draft's KV pool of ``num_blocks`` blocks, its block tables and its runner (eager: no graphs)."""
    block_cache = platform.make_block_cache(draft.spec, num_blocks, draft.attention)
    block_manager = BlockManager(num_blocks, config.cache.block_size, False, draft.model_config.sliding_window)
    sampler = Sampler([], draft.model_config.vocab_size, draft.ops.greedy_pick)
    runner = ModelRunner(
        draft.model, block_cache, block_manager, sampler, platform.torch_device(), draft.model_config.sliding_window,
        draft.ops.apply_token_bitmask,
    )  # fmt: skip
    return DraftParts(
        runner=runner,
        block_manager=block_manager,
        model_path=draft.model_path,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=draft.model_config.max_position_embeddings,
    )
