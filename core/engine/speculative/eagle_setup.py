"""Loading the EAGLE head of ``speculative_config={"method": "eagle" | "eagle3", "model": ...}``: checked
against the target, its weights loaded before the KV pools are sized (so the target's pool leaves the
head's room), then a pool of as many blocks as the target's, since each mirrored sequence holds as many
positions as its target; the target's runner is told to keep the hidden states the head reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.interfaces.block_cache import KVCacheSpec
from engine.interfaces.platform import Platform
from engine.kv_pool import kv_cache_spec
from engine.loader import resolve_model_path
from engine.loader.errors import ModelLoadError
from engine.loader.hf_folder import iter_hf_weights
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.eagle_head import EagleHead, EagleHeadConfig
from engine.models.layers.decoder import DenseDecoder
from engine.sampling.sampler import Sampler
from engine.speculative.eagle import EagleParts
from engine.speculative.eagle_checkpoint import read_eagle_config
from engine.speculative.eagle_hidden import HiddenStore
from engine.speculative.whole_vocabulary import load_whole_vocabulary


@dataclass(slots=True)
class LoadedEagle:
    """An EAGLE head with its weights loaded, its KV pool not made yet."""

    head: EagleHead
    config: EagleHeadConfig
    target: DenseDecoder
    attention: Any
    spec: KVCacheSpec
    bytes_per_block: int


def wants_eagle(config: EngineConfig) -> bool:
    """Whether the configuration speculates with an EAGLE head."""
    spec = config.speculative_config
    return spec is not None and spec.method in ("eagle", "eagle3")


def load_eagle(config: EngineConfig, platform: Platform, target: Any, target_config: ModelConfig) -> LoadedEagle:
    """Load the head on ``platform`` in the target's dtype, sharing the target's embeddings (and, for
    EAGLE-1, its LM head); for EAGLE-3 the target starts keeping its layers' inputs.

    Args:
        config: the engine configuration.
        platform: where the target runs.
        target: the loaded target model.
        target_config: the target's config.

    Raises:
        EngineConfigError: in one line, naming ``speculative_config``: the head cannot be read, or cannot
            propose for this target here (pipeline stages, a target read from a GGUF file under tensor
            parallelism, a platform-run or non-decoder target, a
            head of another hidden size or vocabulary, an unsupported layout).
    """
    spec_config = config.speculative_config
    assert spec_config is not None and spec_config.model is not None
    method = spec_config.method
    assert method in ("eagle", "eagle3")
    where = f"speculative_config method {method!r}"
    # data-parallel replicas are whole engines: each runs a head of its own; under tensor parallelism the
    # driver runs the head beside its shard, with whole copies of the target's embeddings and LM head
    if config.parallel.pipeline_parallel_size > 1:
        raise EngineConfigError(f"{where} runs on one rank; pipeline parallelism is not supported with it")
    if not isinstance(target, DenseDecoder) or target.embed_tokens is None or target.lm_head is None:
        raise EngineConfigError(f"{where} needs the core's model forward for {target_config.architecture}, not a platform-run model")
    try:
        path = resolve_model_path(spec_config.model)
        head_config = read_eagle_config(path, method, target_config)
    except ModelLoadError as exc:
        raise EngineConfigError(f"speculative_config model {spec_config.model}: {exc}") from None
    if head_config.model.head_dim not in platform.capabilities().head_sizes:
        raise EngineConfigError(f"speculative_config model {spec_config.model}: its head size {head_config.model.head_dim} is not supported on {platform.name}")
    if method == "eagle3" and target.fuses_post_norms:
        raise EngineConfigError(f"{where} reads the target's residual stream, which {target_config.architecture}'s fused post-norms do not keep")
    attention = platform.make_attention_backend()
    head = EagleHead(head_config, target, attention)
    if target.tp is not None:
        embed, lm_head = load_whole_vocabulary(config, target, target_config, where)
        head.embed_tokens = embed  # an EAGLE-3 head with embeddings of its own replaces them as it loads
        if head.kind == "eagle":
            head.lm_head = target.gemm.prepare_weight(lm_head, target.dtype)
    try:
        head.load_weights(iter_hf_weights(path, head_config.model, EagleHead))
    except (ModelLoadError, ValueError) as exc:
        raise EngineConfigError(f"speculative_config model {spec_config.model}: {exc}") from None
    if method == "eagle3":
        target.aux_hidden_layers = head_config.aux_layers
    kv = kv_cache_spec(config, head_config.model)
    # each target block also keeps its tokens' hidden states (in the target's dtype) for the head
    width = _store_width(head_config)
    slab = HiddenStore.bytes_per_block(width, config.cache.block_size, platform.element_size(target.dtype))
    return LoadedEagle(head, head_config, target, attention, kv, kv.bytes_per_block(platform.element_size(kv.dtype)) + slab)


def _store_width(head: EagleHeadConfig) -> int:
    """The width of the target's rows the head reads: its last hidden state, or three layers' inputs."""
    return (3 if head.kind == "eagle3" else 1) * head.model.hidden_size


def finish_eagle(
    config: EngineConfig, platform: Platform, loaded: LoadedEagle, num_blocks: int, target_runner: ModelRunner
) -> EagleParts:
    """The head's KV pool of ``num_blocks`` blocks, its block tables and its runner (eager: no graphs);
    the target's runner starts keeping the hidden states the head reads beside its ``num_blocks`` blocks."""
    head = loaded.head
    block_cache = platform.make_block_cache(loaded.spec, num_blocks, loaded.attention)
    block_manager = BlockManager(num_blocks, config.cache.block_size, False, None)
    sampler = Sampler([], head.target_vocab_size, head.ops.greedy_pick)
    runner = ModelRunner(head, block_cache, block_manager, sampler, platform.torch_device(), None, head.ops.apply_token_bitmask)
    store = HiddenStore(
        _store_width(loaded.config), target_runner.block_manager, num_blocks, head.dtype, head.device,
        aux_model=loaded.target if loaded.config.kind == "eagle3" else None,
    )  # fmt: skip
    target_runner.hidden_store = store
    return EagleParts(
        runner=runner,
        block_manager=block_manager,
        head=head,
        store=store,
        model_path=loaded.config.path,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=head.config.max_position_embeddings,
    )
