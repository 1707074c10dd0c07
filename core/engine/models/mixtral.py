"""Mixtral: the Mistral layout with a mixture of experts in every layer (softmax top-k, renormalised)."""

from __future__ import annotations

import re
from types import MappingProxyType

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend, llama_permuted_heads
from engine.models.layers.spec import DecoderSpec, LayerSpec, MoeSpec
from engine.models.llama import standard_rope


class MixtralForCausalLM(DenseDecoder):
    """``MixtralForCausalLM``: ``num_local_experts`` SwiGLU experts per layer (``w1`` gate, ``w3`` up,
    ``w2`` down under ``block_sparse_moe``), ``num_experts_per_tok`` of them per token.

    Loads llama.cpp's ``llama`` files that hold experts: stacked (``ffn_gate_exps``) or, in files written
    before 2024, one tensor per expert (``ffn_gate.<e>``).
    """

    gguf_architectures = MappingProxyType({"llama:experts": "MixtralForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {
            "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
            "ffn_gate_exps.weight": "block_sparse_moe.experts.{}.w1.weight",
            "ffn_up_exps.weight": "block_sparse_moe.experts.{}.w3.weight",
            "ffn_down_exps.weight": "block_sparse_moe.experts.{}.w2.weight",
            "ffn_gate_up_exps.weight": "block_sparse_moe.experts.{}.w1.weight+block_sparse_moe.experts.{}.w3.weight",
        },
        drop=("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"),
    )

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

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str) -> str | None:
        """The stacked names, and the older files' per-expert ``blk.<i>.ffn_<gate|up|down>.<e>.weight``."""
        match = _PER_EXPERT_NAME.match(gguf_name)
        if match:
            layer, projection, expert = match.groups()
            return f"{cls.hf_layer_prefix.format(layer)}block_sparse_moe.experts.{expert}.{_PROJECTIONS[projection]}.weight"
        return super().gguf_tensor_name(gguf_name)

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """llama.cpp's converter permuted the Q/K rows, as for every ``llama`` file."""
        return llama_permuted_heads(name, config) if gguf_architecture == "llama" else 0


_PER_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_PROJECTIONS = MappingProxyType({"gate": "w1", "up": "w3", "down": "w2"})
