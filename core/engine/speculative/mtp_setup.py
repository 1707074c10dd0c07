"""Loading the MTP layer of ``speculative_config={"method": "mtp"}`` (``deepseek_mtp``): read from the
target's own checkpoint (the layer after its last decoder layer, ``num_nextn_predict_layers``), its
weights loaded before the KV pools are sized (so the target's pool leaves its room), then a pool of as many
blocks as the target's. It then runs as an EAGLE-1 head does (:class:`~engine.speculative.eagle.EagleProposer`
over :class:`~engine.speculative.eagle.EagleParts`): it reads the target's last hidden state, kept beside
the target's KV blocks."""

from __future__ import annotations

import os
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
from engine.models.layers.decoder import DenseDecoder
from engine.models.mtp_layer import MtpLayer, mtp_config, mtp_layer_index
from engine.sampling.sampler import Sampler
from engine.speculative.eagle import EagleParts
from engine.speculative.eagle_hidden import HiddenStore
from engine.speculative.whole_vocabulary import load_whole_vocabulary


@dataclass(slots=True)
class LoadedMtp:
    """An MTP layer with its weights loaded, its KV pool not made yet."""

    layer: MtpLayer
    path: str
    attention: Any
    spec: KVCacheSpec
    bytes_per_block: int


def wants_mtp(config: EngineConfig) -> bool:
    """Whether the configuration speculates with the target's MTP layer."""
    spec = config.speculative_config
    return spec is not None and spec.method == "mtp"


def mtp_problem(config: EngineConfig, target: Any, target_config: ModelConfig, path: str) -> str | None:
    """Why the target's MTP layer cannot propose here (None: it can).

    Args:
        config: the engine configuration.
        target: the loaded target model.
        target_config: the target's config.
        path: the target's resolved path.
    """
    hf = target_config.hf_config
    # data-parallel replicas are whole engines: each runs the layer beside its own model; under tensor
    # parallelism the driver runs the whole layer beside its shard, with the target's whole vocabulary
    if config.parallel.pipeline_parallel_size > 1:
        return "runs on one rank; pipeline parallelism is not supported with it"
    if not isinstance(target, DenseDecoder) or target.embed_tokens is None or target.lm_head is None:
        return f"needs the core's model forward for {target_config.architecture}, not a platform-run model"
    if int(hf.get("num_nextn_predict_layers") or 0) < 1:
        return (
            f"needs a checkpoint with multi-token-prediction layers: {target_config.architecture} at {path} "
            "sets no num_nextn_predict_layers (DeepSeek-V3-style checkpoints set it to 1)"
        )
    if not os.path.isdir(path) or config.load_format == "dummy":
        return "reads the MTP layer's weights from the target's HF folder (not a GGUF file or dummy weights)"
    if hf.get("quantization_config") is not None:
        return "does not load the MTP layer of a checkpoint quantized ahead of time yet"
    return None


def load_mtp(config: EngineConfig, platform: Platform, target: Any, target_config: ModelConfig) -> LoadedMtp:
    """Load the target's first MTP layer on ``platform`` in the target's dtype, sharing the target's
    embeddings and LM head where the layer stores none of its own.

    Args:
        config: the engine configuration.
        platform: where the target runs.
        target: the loaded target model.
        target_config: the target's config.

    Raises:
        EngineConfigError: in one line, naming ``speculative_config``: the layer cannot propose for this
            target here (pipeline stages, a platform-run target, a checkpoint without MTP layers,
            GGUF or pre-quantized weights), or its tensors are missing or misshapen.
    """
    where = "speculative_config method 'mtp'"
    path = resolve_model_path(config.model)
    problem = mtp_problem(config, target, target_config, path)
    if problem is not None:
        raise EngineConfigError(f"{where} {problem}")
    attention = platform.make_attention_backend()
    layer_config = mtp_config(target_config)
    layer_class = MtpLayer.for_target(type(target))
    layer = layer_class(layer_config, target, attention)
    if target.tp is not None:
        # a layer storing embeddings or an LM head of its own replaces these as it loads
        embed, lm_head = load_whole_vocabulary(config, target, target_config, where)
        layer.embed_tokens = embed
        layer.lm_head = target.gemm.prepare_weight(lm_head, target.dtype)
    try:
        # unread (lazy) until the layer takes them: only the MTP layer's tensors are read
        weights = list(iter_hf_weights(path, layer_config, layer_class, lazy=True))
    except ModelLoadError as exc:
        raise EngineConfigError(f"{where}: the MTP layer of {path}: {exc}") from None
    if not weights:
        # transformers' save_pretrained drops the layer but keeps the config key (re-saved fine-tunes)
        raise EngineConfigError(
            f"{where} needs a checkpoint with multi-token-prediction layers: {path} sets "
            f"num_nextn_predict_layers {target_config.hf_config['num_nextn_predict_layers']} but stores no "
            f"model.layers.{mtp_layer_index(layer_config)}.* tensors"
        )
    try:
        layer.load_weights(weights)
    except (ModelLoadError, ValueError) as exc:
        raise EngineConfigError(f"{where}: the MTP layer of {path}: {exc}") from None
    kv = kv_cache_spec(config, layer_config, num_layers=1)
    # each target block also keeps its tokens' last hidden states (in the target's dtype) for the layer
    slab = HiddenStore.bytes_per_block(target_config.hidden_size, config.cache.block_size, platform.element_size(target.dtype))
    return LoadedMtp(layer, path, attention, kv, kv.bytes_per_block(platform.element_size(kv.dtype)) + slab)


def finish_mtp(
    config: EngineConfig, platform: Platform, loaded: LoadedMtp, num_blocks: int, target_runner: ModelRunner
) -> EagleParts:
    """The layer's KV pool of ``num_blocks`` blocks, its block tables and its runner (eager: no graphs);
    the target's runner starts keeping its last hidden states beside its ``num_blocks`` blocks."""
    layer = loaded.layer
    block_cache = platform.make_block_cache(loaded.spec, num_blocks, loaded.attention)
    block_manager = BlockManager(num_blocks, config.cache.block_size, False, None)
    sampler = Sampler([], layer.target_vocab_size, layer.ops.greedy_pick)
    runner = ModelRunner(layer, block_cache, block_manager, sampler, platform.torch_device(), None, layer.ops.apply_token_bitmask)
    store = HiddenStore(layer.config.hidden_size, target_runner.block_manager, num_blocks, layer.dtype, layer.device)
    target_runner.hidden_store = store
    return EagleParts(
        runner=runner,
        block_manager=block_manager,
        head=layer,
        store=store,
        model_path=loaded.path,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=layer.config.max_position_embeddings,
    )
