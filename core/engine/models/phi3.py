"""Phi-3 / Phi-4-mini: fused q/k/v and gate/up projections, partial rotary, ``longrope`` scaling."""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.hf_config import sliding_window
from engine.models.layers.spec import DecoderSpec, LayerSpec
from engine.models.llama import standard_rope


class Phi3ForCausalLM(DenseDecoder):
    """``Phi3ForCausalLM``: ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` as stored; every layer
    slides by ``sliding_window`` when the config sets one. Loads llama.cpp's ``phi3`` GGUF files, which keep
    both fused projections (``attn_qkv``, and ``ffn_up`` holding gate then up)."""

    gguf_architectures = MappingProxyType({"phi3": "Phi3ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
        drop=("ffn_gate.weight",),
    )

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers with fused projections."""
        window = sliding_window(config.hf_config) if config.hf_config else config.sliding_window
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=window) for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            fused_qkv="self_attn.qkv_proj",
            fused_gate_up="mlp.gate_up_proj",
        )
