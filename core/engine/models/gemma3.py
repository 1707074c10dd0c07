"""Gemma 3 (text): Gemma 2's layout with per-head q/k norms and separate RoPE bases (and scalings) for
the local and the global layers."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.gemma2 import (
    GEMMA_GGUF_LAYER_NAMES,
    GEMMA_NORMS,
    Gemma2ForCausalLM,
    gemma_activation,
    optional_float,
)
from engine.models.layers.gguf_names import QK_NORM_NAMES, extend
from engine.models.layers.hf_config import FULL, SLIDING, layer_types, sliding_window
from engine.models.layers.spec import DecoderSpec, LayerSpec, RopeSpec
from engine.models.llama import standard_rope


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """``Gemma3ForCausalLM`` (the text-only model, ``Gemma3TextConfig``). Loads llama.cpp's ``gemma3`` GGUF
    files (norm scales, q/k norms included, stored as ``1 + w``)."""

    gguf_architectures = MappingProxyType({"gemma3": "Gemma3ForCausalLM"})
    gguf_layer_tensor_names = extend(GEMMA_GGUF_LAYER_NAMES, QK_NORM_NAMES)

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Local layers use rotary 1 (``rope_local_base_freq``), global layers rotary 0."""
        hf, n = config.hf_config, config.num_layers
        pattern = int(hf.get("sliding_window_pattern") or 6)
        default = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        types = layer_types(hf, n, default)
        window = sliding_window(hf)
        global_rope = standard_rope(config, FULL)
        local_rope = standard_rope(config, SLIDING)
        if "rope_local_base_freq" in hf or not isinstance((hf.get("rope_parameters") or {}).get(SLIDING), dict):
            # transformers < 5 spells the local base as a top-level key, with plain RoPE
            local_rope = RopeSpec(float(hf.get("rope_local_base_freq") or 10000.0), None, global_rope.rotary_dim)
        return DecoderSpec(
            layers=tuple(
                LayerSpec(sliding_window=window, rope=1) if t == SLIDING else LayerSpec(rope=0) for t in types
            ),
            ropes=(global_rope, local_rope),
            norms=GEMMA_NORMS,
            gemma_norms=True,
            qk_norm="head",
            activation=gemma_activation(hf),
            scale=float(hf.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
            attn_soft_cap=optional_float(hf.get("attn_logit_softcapping")),
            embed_scale=config.hidden_size**0.5,
            final_soft_cap=optional_float(hf.get("final_logit_softcapping")),
        )
