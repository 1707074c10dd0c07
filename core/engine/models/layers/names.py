"""The HF tensor names and shapes of a :class:`DecoderSpec`'s checkpoints."""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.layers.mla_block import mla_weight_shapes
from engine.models.layers.moe_block import moe_weight_shapes
from engine.models.layers.spec import DecoderSpec


def qkv_names(spec: DecoderSpec) -> tuple[str, ...]:
    """The attention input projections: one fused name, or q, k and v."""
    return (spec.fused_qkv,) if spec.fused_qkv else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def gate_up_names(spec: DecoderSpec) -> tuple[str, ...]:
    """The MLP input projections: one fused name, or gate and up."""
    return (spec.fused_gate_up,) if spec.fused_gate_up else ("mlp.gate_proj", "mlp.up_proj")


def norm_shapes(spec: DecoderSpec, name: str, size: int) -> dict[str, tuple[int, ...]]:
    """A layer or final norm's tensors: its scale, and its bias for LayerNorms that have one."""
    shapes: dict[str, tuple[int, ...]] = {name + ".weight": (size,)}
    if spec.norm == "layer" and spec.norm_bias:
        shapes[name + ".bias"] = (size,)
    return shapes


def qk_norm_shapes(spec: DecoderSpec, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The q norm's and the k norm's tensors (names after the layer prefix), empty without q/k norms."""
    if spec.qk_norm == "none":
        return {}, {}
    hd = config.head_dim
    result = []
    for name, heads in zip(spec.qk_norm_names, (config.num_heads, config.num_kv_heads)):
        if spec.qk_norm == "full":
            result.append({name + ".weight": (heads * hd,)})
        elif spec.qk_norm == "head":
            result.append({name + ".weight": (hd,)})
        elif spec.qk_norm_split:
            result.append({f"{name}.norms.{h}.weight": (hd,) for h in range(heads)})
        else:
            result.append({name + ".weight": (heads, hd)})
    return result[0], result[1]


def decoder_weight_shapes(spec: DecoderSpec, config: ModelConfig, layer_prefix: str = "model.layers.{}.") -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` provides, by HF name, in load order.

    Args:
        spec: the architecture's spec.
        config: the model config.
        layer_prefix: the HF prefix of layer ``i``.

    Returns:
        HF name -> shape; ``lm_head.weight`` is absent when the embeddings are tied.
    """
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(len(spec.layers)):
        p = layer_prefix.format(i)
        norms = spec.norms
        if norms.pre_attn:
            shapes.update(norm_shapes(spec, p + norms.pre_attn, hidden))
        if spec.mla is not None:
            shapes.update(mla_weight_shapes(spec.mla, config, p))
        elif spec.fused_qkv:
            shapes[p + spec.fused_qkv + ".weight"] = (q_size + 2 * kv_size, hidden)
            if spec.qkv_bias:
                shapes[p + spec.fused_qkv + ".bias"] = (q_size + 2 * kv_size,)
        else:
            names = qkv_names(spec)
            for name, rows in zip(names, (q_size, kv_size, kv_size)):
                shapes[p + name + ".weight"] = (rows, hidden)
            if spec.qkv_bias:
                for name, rows in zip(names, (q_size, kv_size, kv_size)):
                    shapes[p + name + ".bias"] = (rows,)
        if spec.mla is None:
            for qk_shapes in qk_norm_shapes(spec, config):
                shapes.update({p + name: shape for name, shape in qk_shapes.items()})
            shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
            if spec.attention_sinks:
                shapes[p + "self_attn.sinks"] = (config.num_heads,)
            if spec.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        for norm in (norms.post_attn, norms.pre_mlp):
            if norm:
                shapes.update(norm_shapes(spec, p + norm, hidden))
        if spec.layers[i].moe:
            assert spec.moe is not None
            shapes.update(moe_weight_shapes(spec.moe, hidden, p))
        elif spec.fused_gate_up:
            shapes[p + spec.fused_gate_up + ".weight"] = (2 * inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        else:
            for name in gate_up_names(spec):
                shapes[p + name + ".weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        if norms.post_mlp:
            shapes.update(norm_shapes(spec, p + norms.post_mlp, hidden))
    shapes.update(norm_shapes(spec, "model.norm", hidden))
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
