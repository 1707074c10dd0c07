"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2) written against the plugin interfaces.

The model never calls a kernel directly: matrix products go through the platform's GemmBackend,
attention through its AttentionBackend, and the small fused ops through its OpTable.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.ops import OpTable
from engine.loader.quantized import concat_weights
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.rotary import build_cos_sin_cache
from engine.models.weights import take_tensor


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Any
    qkv_bias: torch.Tensor | None
    o_proj: Any
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Any
    down: Any
    #: the FP8 dtype each projection takes its input pre-quantized in (GemmBackend.row_quantized_input)
    qkv_fp8: Any = None
    gate_up_fp8: Any = None
    down_fp8: Any = None


class LlamaForCausalLM(CausalLM):
    """A decoder-only transformer with RMSNorm, rotary embeddings, GQA and a SwiGLU MLP.

    Registered in the core for ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``;
    loads GGUF files of llama.cpp's ``llama`` and ``qwen2`` architectures.

    Args:
        config: the model's sizes.
        ops: the op table (reference ops with the platform's overrides).
        attention: the platform's attention backend.
        gemm: the platform's GEMM backend.
        dtype: activation and weight dtype.
        device: where tensors live.
    """

    # Mistral GGUFs say "llama"
    gguf_architectures = MappingProxyType({"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"})
    gguf_global_tensor_names = MappingProxyType(
        {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        }
    )
    gguf_layer_tensor_names = MappingProxyType(
        {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_q.weight": "self_attn.q_proj.weight",
            "attn_q.bias": "self_attn.q_proj.bias",
            "attn_k.weight": "self_attn.k_proj.weight",
            "attn_k.bias": "self_attn.k_proj.bias",
            "attn_v.weight": "self_attn.v_proj.weight",
            "attn_v.bias": "self_attn.v_proj.bias",
            "attn_output.weight": "self_attn.o_proj.weight",
            "attn_output.bias": "self_attn.o_proj.bias",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight",
            "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        }
    )

    def __init__(
        self,
        config: ModelConfig,
        ops: OpTable,
        attention: AttentionBackend,
        gemm: GemmBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(config, ops, attention, gemm, dtype, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.cos_sin_cache = build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device
        )
        self.layers: list[_Layer] = []
        self.embed_tokens: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Any = None

    # --- what the loader asks of the class ----------------------------------------------------------

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every parameter of a Llama/Mistral/Qwen2 checkpoint, by HF name, in load order.

        Args:
            config: the model config.

        Returns:
            HF parameter name -> shape. ``lm_head.weight`` is absent when the embeddings are tied. With
            ``attention_bias``, q/k/v get biases, and so does o_proj except for Qwen2 (as in the HF models).
        """
        hidden, inter = config.hidden_size, config.intermediate_size
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (hidden,)
            shapes[p + "self_attn.q_proj.weight"] = (q_size, hidden)
            shapes[p + "self_attn.k_proj.weight"] = (kv_size, hidden)
            shapes[p + "self_attn.v_proj.weight"] = (kv_size, hidden)
            if config.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
            if config.attention_bias and config.architecture != "Qwen2ForCausalLM":
                # HF Llama/Mistral's attention_bias also covers o_proj; Qwen2 has q/k/v biases only.
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes["model.norm.weight"] = (hidden,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, hidden)
        return shapes

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Recomputed rotary buffers, and the copy of the embeddings some tied checkpoints store."""
        return super().ignores_weight(name, config) or (config.tie_word_embeddings and name == "lm_head.weight")

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """llama.cpp's converter permuted the Q/K rows of ``llama`` files (not ``qwen2``) for its rotary layout."""
        if gguf_architecture != "llama":
            return 0
        return config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else 0

    # --- loading -------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors, fuse q/k/v and gate/up, and hand every matrix to the GEMM backend.

        Raises:
            ValueError: if a tensor the architecture needs is missing or has the wrong shape.
        """
        cfg = self.config
        tensors: dict[str, Any] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            tensors[name] = tensor

        def take(name: str, shape: tuple[int, ...]) -> Any:
            return take_tensor(tensors, name, shape)

        def vec(name: str, size: int) -> torch.Tensor:
            return take(name, (size,)).to(device=self.device, dtype=self.dtype)

        def mat(t: torch.Tensor | QuantizedWeight, projection: bool = True) -> Any:
            # a quantized weight goes to the GEMM backend as the loader found it: packing is the backend's job
            if isinstance(t, QuantizedWeight):
                return self.gemm.prepare_weight(t, self.dtype)
            t = t.to(self.device)
            if projection and self.linear_quantizer is not None:
                return self.gemm.prepare_weight(self.linear_quantizer(t), self.dtype)
            return self.gemm.prepare_weight(t, self.dtype)

        h, hd = cfg.hidden_size, cfg.head_dim
        embed = take("model.embed_tokens.weight", (cfg.vocab_size, h))
        dense_embed = embed.dequantize() if isinstance(embed, QuantizedWeight) else embed
        self.embed_tokens = dense_embed.to(device=self.device, dtype=self.dtype)
        del dense_embed
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q = take(p + "self_attn.q_proj.weight", (self.q_size, h))
            k = take(p + "self_attn.k_proj.weight", (self.kv_size, h))
            v = take(p + "self_attn.v_proj.weight", (self.kv_size, h))
            bias = None
            if cfg.attention_bias:
                bias = torch.cat(
                    [
                        take(p + "self_attn.q_proj.bias", (self.q_size,)),
                        take(p + "self_attn.k_proj.bias", (self.kv_size,)),
                        take(p + "self_attn.v_proj.bias", (self.kv_size,)),
                    ]
                ).to(device=self.device, dtype=self.dtype)
            gate = take(p + "mlp.gate_proj.weight", (cfg.intermediate_size, h))
            up = take(p + "mlp.up_proj.weight", (cfg.intermediate_size, h))
            self.layers.append(
                _Layer(
                    input_norm=vec(p + "input_layernorm.weight", h),
                    qkv=mat(concat_weights([q, k, v])),
                    qkv_bias=bias,
                    o_proj=mat(take(p + "self_attn.o_proj.weight", (h, cfg.num_heads * hd))),
                    # Llama/Mistral checkpoints with attention_bias also bias o_proj; Qwen2's has none.
                    o_bias=vec(p + "self_attn.o_proj.bias", h) if p + "self_attn.o_proj.bias" in tensors else None,
                    post_norm=vec(p + "post_attention_layernorm.weight", h),
                    gate_up=mat(concat_weights([gate, up])),
                    down=mat(take(p + "mlp.down_proj.weight", (h, cfg.intermediate_size))),
                )
            )
            layer = self.layers[-1]
            layer.qkv_fp8 = self.gemm.row_quantized_input(layer.qkv)
            layer.gate_up_fp8 = self.gemm.row_quantized_input(layer.gate_up)
            layer.down_fp8 = self.gemm.row_quantized_input(layer.down)
        self.final_norm = vec("model.norm.weight", h)
        # the lm_head stays in the model dtype under load-time quantization: its logits pick the tokens
        if cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = mat(embed, projection=False)
        else:
            self.lm_head = mat(take("lm_head.weight", (cfg.vocab_size, h)), projection=False)
        tensors.pop("lm_head.weight", None)

    # --- forward -------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm, for a flat batch of tokens."""
        cfg, ops, gemm = self.config, self.ops, self.gemm
        num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens.index_select(0, input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            elif layer.qkv_fp8 is not None:
                # the norm writes the W8A8 GEMM's FP8 input itself: one pass over the activations fewer
                x, residual = ops.fused_add_rms_norm_fp8(hidden, residual, layer.input_norm, cfg.rms_norm_eps, layer.qkv_fp8)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            qkv = gemm.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            q, k = ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
            attn = self.attention.forward(q, k, v, kv_cache, metadata)
            hidden = gemm.linear(attn.reshape(num_tokens, self.q_size), layer.o_proj, layer.o_bias)
            if layer.gate_up_fp8 is not None:
                x, residual = ops.fused_add_rms_norm_fp8(hidden, residual, layer.post_norm, cfg.rms_norm_eps, layer.gate_up_fp8)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            gate_up = gemm.linear(x, layer.gate_up)
            if layer.down_fp8 is not None:
                hidden = gemm.linear(ops.silu_and_mul_fp8(gate_up, layer.down_fp8), layer.down)
            else:
                hidden = gemm.linear(ops.silu_and_mul(gate_up), layer.down)
        out, _ = ops.fused_add_rms_norm(hidden, residual, self.final_norm, cfg.rms_norm_eps)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` for the selected hidden rows."""
        return self.gemm.logits(hidden, self.lm_head)
