"""SmolLM3: the Llama layout where the layers ``no_rope_layers`` marks 0 attend without positions."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, llama_permuted_heads
from engine.models.layers.hf_config import layer_windows
from engine.models.layers.spec import DecoderSpec, LayerSpec
from engine.models.llama import standard_rope


class SmolLM3ForCausalLM(DenseDecoder):
    """``SmolLM3ForCausalLM``: ``no_rope_layers[i]`` is 1 for a layer with RoPE, 0 for one without
    (every ``no_rope_layer_interval``-th layer when the list is absent). Loads llama.cpp's ``smollm3`` GGUF
    files, whose converter permutes the Q/K rows as for ``llama``."""

    gguf_architectures = MappingProxyType({"smollm3": "SmolLM3ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = LAYER_NAMES

    tie_embeddings_default: ClassVar[bool] = True

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers, some without rotary."""
        hf, n = config.hf_config, config.num_layers
        interval = int(hf.get("no_rope_layer_interval") or 4)
        uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        windows = layer_windows(hf, n)
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=w, rope=0 if r else None) for w, r in zip(windows, uses_rope)),
            ropes=(standard_rope(config),),
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
        )

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """The ``smollm3`` converter is the ``llama`` one: Q/K rows interleaved per head."""
        return llama_permuted_heads(name, config)
