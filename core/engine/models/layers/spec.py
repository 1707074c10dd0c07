"""What distinguishes one dense decoder architecture from another, as data.

An architecture file builds a :class:`DecoderSpec` from its config; the shared decoder
(:class:`engine.models.layers.decoder.DenseDecoder`) loads and runs any spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.interfaces.moe import MoeActivation

#: ``head``: one norm of ``head_dim`` shared by every head (Qwen3, Gemma3); ``full``: over all heads (OLMo2);
#: ``each_head``: over ``head_dim`` with a scale of its own per head, ``[heads, head_dim]`` (StableLM, Cohere)
QKNorm = Literal["none", "head", "full", "each_head"]
#: ``rms``: RMSNorm; ``layer``: LayerNorm (mean removed), with a bias where :attr:`DecoderSpec.norm_bias`
NormKind = Literal["rms", "layer"]
#: ``silu``: SwiGLU; ``gelu_tanh``: GeGLU with the tanh approximation (Gemma)
Activation = Literal["silu", "gelu_tanh"]
#: how a checkpoint stores the experts: ``per_expert``: ``{expert}{proj}.weight`` per expert and projection;
#: ``stacked``: transformers' gpt-oss layout, ``{expert}gate_up_proj`` ``[experts, hidden, 2 * inter]`` with
#: the gate and up columns interleaved, ``{expert}down_proj`` ``[experts, inter, hidden]`` (and ``_bias``
#: tensors); ``stacked_mxfp4``: the same as MXFP4 ``_blocks`` / ``_scales`` (``[experts, out, in / 32, 16]``
#: bytes of two FP4 values, one power-of-two scale per 32), dequantized at load
ExpertLayout = Literal["per_expert", "stacked", "stacked_mxfp4"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary embedding (a model may have several, e.g. Gemma3's local and global bases).

    Attributes:
        theta: the base.
        scaling: HF RoPE parameters (``rope_type`` and its keys), None for plain RoPE.
        rotary_dim: how many leading dims of each head rotate (``partial_rotary_factor``).
        interleaved: GLM's pairs ``(2i, 2i+1)`` instead of NeoX halves; the loader permutes the Q/K rows
            into halves so one rotary op serves both.
    """

    theta: float
    scaling: dict[str, Any] | None
    rotary_dim: int
    interleaved: bool = False


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Per-layer attention variation.

    Attributes:
        sliding_window: the layer's attention window, None for global attention.
        rope: index into :attr:`DecoderSpec.ropes`, None for a layer without positions (SmolLM3).
        moe: the layer's MLP is the mixture of experts :attr:`DecoderSpec.moe` describes.
    """

    sliding_window: int | None = None
    rope: int | None = 0
    moe: bool = False


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts MLP (the layers whose :attr:`LayerSpec.moe` is set have one).

    Attributes:
        num_experts: experts per layer.
        top_k: experts each token goes through.
        renormalize: the chosen experts' softmax weights are scaled to sum to 1 (Mixtral, Qwen3-MoE's
            ``norm_topk_prob``).
        intermediate_size: each expert's MLP width.
        router: the router's name after the layer prefix (``mlp.gate``).
        expert: expert ``e``'s prefix after the layer prefix, with ``{}`` for ``e``.
        expert_projections: the gate, up and down projections' names after the expert prefix.
        shared_intermediate_size: the width of a shared expert every token also goes through (Qwen2-MoE),
            None without one.
        shared_expert: the shared expert's prefix after the layer prefix.
        shared_expert_gate: the name of its sigmoid gate ``[1, hidden]`` (Qwen2-MoE), None without one.
        scoring: ``"softmax"`` over the experts, or ``"sigmoid"`` per expert (DeepSeek-V3, GLM-4.5).
        correction_bias: the name of the router's ``[experts]`` bias that moves the choice but not the
            weights (``mlp.gate.e_score_correction_bias``), None without one.
        num_groups: expert groups of group-limited routing (1: none).
        topk_groups: groups a token may choose from.
        routed_scaling_factor: factor on the routed experts' weights.
        group_score: a group's score in group-limited routing: the sum of its two best choices (``top2``,
            DeepSeek-V3) or its best (``max``, DeepSeek-V2).
        layout: how the checkpoint stores the experts (``expert`` has no ``{}`` for the stacked layouts).
        expert_bias: the experts' projections have biases (gpt-oss).
        router_bias: the router has a ``.bias`` (gpt-oss).
        activation: the experts' gated activation (``swigluoai``: gpt-oss's clamped SwiGLU).
    """

    num_experts: int
    top_k: int
    renormalize: bool
    intermediate_size: int
    router: str = "mlp.gate"
    expert: str = "mlp.experts.{}."
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_intermediate_size: int | None = None
    shared_expert: str = "mlp.shared_expert."
    shared_expert_gate: str | None = None
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    correction_bias: str | None = None
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    group_score: Literal["top2", "max"] = "top2"
    layout: ExpertLayout = "per_expert"
    expert_bias: bool = False
    router_bias: bool = False
    activation: MoeActivation = "silu"


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one compressed latent per
    token, with a small rotary key shared by every head.

    The engine runs it *absorbed*: each head's query is taken into the latent space (through its slice of
    ``kv_b_proj``), so attention is multi-query over ``[latent, rotary key]`` rows of
    ``kv_lora_rank + qk_rope_head_dim`` (the model's ``head_dim``, one KV head), and each head's output
    leaves the latent space through its value slice of ``kv_b_proj``. The cache holds the latent rows.

    Attributes:
        q_lora_rank: the width of the compressed query (``q_a_proj`` / ``q_b_proj``), None for one ``q_proj``.
        kv_lora_rank: the latent's width.
        qk_nope_head_dim: each head's query/key width without positions.
        qk_rope_head_dim: the rotary part's width.
        v_head_dim: each head's value width.
        interleaved_rope: the checkpoint's rotary pairs adjacent dims (``rope_interleave``); the loader
            reorders those rows into halves.
        split_kv_b: the checkpoint holds ``kv_b_proj`` as llama.cpp's newer converters write it: a
            ``k_b_proj`` ``[heads, latent, nope]`` (the key part transposed) and a ``v_b_proj``
            ``[heads, v, latent]``.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool = True
    split_kv_b: bool = False


@dataclass(frozen=True, slots=True)
class NormNames:
    """HF names (after the layer prefix, without ``.weight``) of each layer's norms; None where absent.

    Attributes:
        pre_attn: before attention (``input_layernorm``).
        post_attn: on the attention output, before the residual add (Gemma2/3, OLMo2, GLM4).
        pre_mlp: before the MLP (Llama's ``post_attention_layernorm``).
        post_mlp: on the MLP output, before the residual add.
    """

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """Everything the shared decoder needs to know about an architecture.

    Attributes:
        layers: one :class:`LayerSpec` per layer.
        ropes: the rotary embeddings layers refer to.
        norms: per-layer norm names.
        gemma_norms: RMSNorm scales are stored as ``w`` and applied as ``1 + w`` (made ``1 + w`` at load).
        norm: every norm's kind (layer, q/k and final norms alike).
        norm_bias: LayerNorms have a ``.bias`` next to their ``.weight`` (StableLM).
        qk_norm: a norm on queries and keys before the rotary.
        qk_norm_names: the q and k norms' names after the layer prefix.
        qk_norm_split: ``each_head`` scales are stored one tensor per head, ``{name}.norms.{h}.weight``
            (StableLM), not as one ``[heads, head_dim]`` tensor (Cohere).
        parallel: attention and MLP both read the pre-attention norm's output and their outputs are
            added to the residual together (GPT-NeoX style: StableLM's ``use_parallel_residual``, Cohere).
        fused_qkv: the name of a fused q/k/v projection (Phi3's ``self_attn.qkv_proj``), else separate
            ``self_attn.{q,k,v}_proj``.
        qkv_bias: q/k/v projections have biases.
        o_bias: the output projection has a bias.
        fused_gate_up: the name of a fused gate/up projection (``mlp.gate_up_proj``), else separate.
        activation: the MLP's gated activation.
        scale: the attention softmax scale.
        attn_soft_cap: attention logits soft-cap, or None.
        embed_scale: embeddings are multiplied by this (rounded to the model dtype first, as HF does).
        residual_multiplier: each branch output is multiplied by this before the residual add (Granite).
        logits_divisor: logits are divided by this (Granite's ``logits_scaling``).
        logit_scale: logits are multiplied by this (Cohere's ``logit_scale``).
        final_soft_cap: final logits soft-cap (Gemma2).
        moe: the mixture of experts of the layers marked ``moe``, None for a dense model.
        mla: multi-head latent attention in place of q/k/v projections, None for the usual attention.
        attention_sinks: every layer has a learned per-head sink logit, ``self_attn.sinks`` ``[heads]``
            (gpt-oss): one more softmax term with no value.
    """

    layers: tuple[LayerSpec, ...]
    ropes: tuple[RopeSpec, ...]
    norms: NormNames = field(default_factory=NormNames)
    gemma_norms: bool = False
    norm: NormKind = "rms"
    norm_bias: bool = False
    qk_norm: QKNorm = "none"
    qk_norm_names: tuple[str, str] = ("self_attn.q_norm", "self_attn.k_norm")
    qk_norm_split: bool = False
    parallel: bool = False
    fused_qkv: str | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    fused_gate_up: str | None = None
    activation: Activation = "silu"
    scale: float | None = None
    attn_soft_cap: float | None = None
    embed_scale: float | None = None
    residual_multiplier: float | None = None
    logits_divisor: float | None = None
    logit_scale: float | None = None
    final_soft_cap: float | None = None
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None
    attention_sinks: bool = False
