"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2) on the shared decoder blocks.

The model never calls a kernel directly: matrix products go through the platform's GemmBackend,
attention through its AttentionBackend, and the small fused ops through its OpTable.
"""

from __future__ import annotations

from types import MappingProxyType

from engine.models.config import QWEN2_ARCHITECTURES, ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, llama_permuted_heads
from engine.models.layers.hf_config import rope_parameters, scaling_of
from engine.models.layers.spec import DecoderSpec, LayerSpec, RopeSpec


def standard_rope(config: ModelConfig, layer_type: str | None = None, interleaved: bool = False) -> RopeSpec:
    """A rotary as the HF config spells it (``rope_parameters`` or top-level keys), or from the
    config's ``rope_theta`` / ``rope_scaling`` for GGUF files.

    Args:
        config: the model config.
        layer_type: the layer type whose parameters to read (Gemma3's per-type ``rope_parameters``).
        interleaved: GLM's pairwise rotary layout.

    Returns:
        The rotary's spec; ``dynamic`` scaling carries the config's ``max_position_embeddings`` as
        ``original_max_position_embeddings`` (the engine widens the context by the factor).
    """
    hf = config.hf_config
    if not hf:
        return RopeSpec(config.rope_theta, config.rope_scaling, config.head_dim)
    params = rope_parameters(hf, layer_type)
    scaling = scaling_of(params)
    if scaling is not None and scaling["rope_type"] == "dynamic":
        scaling = {**scaling, "original_max_position_embeddings": int(hf["max_position_embeddings"])}
    rotary_dim = int(config.head_dim * float(params["partial_rotary_factor"]))
    return RopeSpec(float(params["rope_theta"]), scaling, rotary_dim, interleaved)


class LlamaForCausalLM(DenseDecoder):
    """A decoder-only transformer with RMSNorm, rotary embeddings, GQA and a SwiGLU MLP.

    Registered in the core for ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``;
    loads GGUF files of llama.cpp's ``llama`` and ``qwen2`` architectures.
    """

    # Mistral GGUFs say "llama" (llama.cpp's converter writes no sliding window for them; a file that has
    # ``llama.attention.sliding_window`` gets it on every layer)
    gguf_architectures = MappingProxyType({"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = LAYER_NAMES

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm SwiGLU layers with one rotary; ``attention_bias`` also biases o_proj except for Qwen2
        (as in the HF models); Mistral's window applies to every layer."""
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=config.sliding_window) for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias and config.architecture not in QWEN2_ARCHITECTURES,
        )

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """llama.cpp's converter permuted the Q/K rows of ``llama`` files (not ``qwen2``) for its rotary layout."""
        return llama_permuted_heads(name, config) if gguf_architecture == "llama" else 0
