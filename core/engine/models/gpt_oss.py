"""gpt-oss (``GptOssForCausalLM``): pre-norm layers alternating sliding-window and global attention, each
head with a learned attention sink, q/k/v/o biases, YaRN positions, and a mixture of experts in every layer:
a biased router (softmax over the top-k logits), experts with biases and the clamped SwiGLU.

The experts load from transformers' stacked layout, from the MXFP4 blocks and scales the released
checkpoints ship (dequantized at load to the model dtype), or from llama.cpp's ``gpt-oss`` GGUF files (a
tensor per projection and expert stack, gate and up apart; MXFP4 dequantized at load)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from engine.interfaces.moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.gguf_names import GLOBAL_NAMES, LAYER_NAMES, extend
from engine.models.layers.hf_config import FULL, SLIDING, layer_windows
from engine.models.layers.spec import DecoderSpec, ExpertLayout, LayerSpec, MoeSpec
from engine.models.llama import standard_rope


def expert_layout(hf: dict[str, Any]) -> ExpertLayout:
    """``stacked_mxfp4`` for a checkpoint whose ``quantization_config`` says ``mxfp4``, ``per_expert`` for a
    GGUF file (its loader says so in ``expert_layout``), else ``stacked``.

    Raises:
        ValueError: another quantization method.
    """
    if hf.get("expert_layout") == "per_expert":
        return "per_expert"
    quant = hf.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is None:
        return "stacked"
    if method == "mxfp4":
        return "stacked_mxfp4"
    raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported (supported: mxfp4)")


class GptOssForCausalLM(DenseDecoder):
    """``GptOssForCausalLM``.

    Raises:
        ValueError: a ``swiglu_alpha`` or ``swiglu_limit`` other than the released models' (1.702 and 7),
            which the fused-MoE op's ``swigluoai`` activation has built in.
    """

    gguf_architectures = MappingProxyType({"gpt-oss": "GptOssForCausalLM"})
    gguf_global_tensor_names = GLOBAL_NAMES
    # llama.cpp's post_attention_norm is the norm before the experts (HF's post_attention_layernorm)
    gguf_layer_tensor_names = extend(
        LAYER_NAMES,
        {
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp.weight": "mlp.router.weight",
            "ffn_gate_inp.bias": "mlp.router.bias",
            **{f"ffn_{p}_exps.{kind}": f"mlp.experts.{{}}.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")},
            **{f"ffn_gate_up_exps.{kind}": f"mlp.experts.{{}}.gate_proj.{kind}+mlp.experts.{{}}.up_proj.{kind}" for kind in ("weight", "bias")},
        },
        drop=("ffn_norm.weight",),
    )

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """Alternating windows (even layers slide unless ``layer_types`` says otherwise), sinks, experts."""
        hf, n = config.hf_config, config.num_layers
        alpha, limit = float(hf.get("swiglu_alpha", SWIGLUOAI_ALPHA)), float(hf.get("swiglu_limit", SWIGLUOAI_LIMIT))
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise ValueError(
                f"gpt-oss swiglu_alpha={alpha} swiglu_limit={limit} is not supported "
                f"(supported: {SWIGLUOAI_ALPHA} and {SWIGLUOAI_LIMIT})"
            )
        moe = MoeSpec(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            renormalize=True,  # a softmax over the chosen logits is the full softmax renormalised over them
            intermediate_size=config.intermediate_size,
            router="mlp.router",
            expert="mlp.experts.{}." if expert_layout(hf) == "per_expert" else "mlp.experts.",
            layout=expert_layout(hf),
            expert_bias=True,
            router_bias=True,
            activation="swigluoai",
        )
        default = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
        return DecoderSpec(
            layers=tuple(LayerSpec(sliding_window=w, moe=True) for w in layer_windows(hf, n, default)),
            ropes=(standard_rope(config),),
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            moe=moe,
            attention_sinks=True,
        )
