"""Mixtral: the Mistral layout with a mixture of experts in every layer (softmax top-k, renormalised)."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.spec import DecoderSpec, LayerSpec, MoeSpec
from engine.models.llama import standard_rope


class MixtralForCausalLM(DenseDecoder):
    """``MixtralForCausalLM``: ``num_local_experts`` SwiGLU experts per layer (``w1`` gate, ``w3`` up,
    ``w2`` down under ``block_sparse_moe``), ``num_experts_per_tok`` of them per token."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Pre-norm layers, every one a mixture of experts; Mistral's window on every layer if set."""
        hf = config.hf_config
        moe = MoeSpec(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            renormalize=True,
            intermediate_size=config.intermediate_size,
            router="block_sparse_moe.gate",
            expert="block_sparse_moe.experts.{}.",
            expert_projections=("w1", "w3", "w2"),
        )
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=config.sliding_window, moe=True) for _ in range(config.num_layers)),
            ropes=(standard_rope(config),),
            moe=moe,
        )
