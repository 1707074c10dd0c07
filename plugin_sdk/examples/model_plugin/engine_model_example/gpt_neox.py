"""GPT-NeoX (EleutherAI's Pythia, GPT-NeoX-20B) written against the plugin interfaces.

Unlike Llama: one fused ``query_key_value`` projection whose rows are ordered head by head (q, k, v of
head 0, then of head 1, ...), LayerNorm with a bias, rotary embeddings on only the first
``partial_rotary_factor`` (``rotary_pct``) of each head, a GELU MLP with biases, attention and MLP
computed in parallel from the same input (``use_parallel_residual``), and an untied ``embed_out`` head.

Matrix products and attention go through the platform's backends. LayerNorm, GELU and the partial
rotary are computed in plain torch here: the op table has none of them, and a third-party model plugin
is free to do so (a core model would add such ops to the plugin contract instead, so that platforms
can override them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_plugin_sdk import AttentionBackend, AttentionMetadata, GemmBackend, OpTable, QuantizedWeight
from engine_plugin_sdk.models import CausalLM, ModelConfig, build_cos_sin_cache, take_tensor

# HF ``hidden_act`` -> torch's GELU variant ("gelu_new" is the tanh approximation)
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(slots=True)
class _Layer:
    input_norm: tuple[torch.Tensor, torch.Tensor]
    post_norm: tuple[torch.Tensor, torch.Tensor]
    qkv: Any
    qkv_bias: torch.Tensor | None
    dense: Any
    dense_bias: torch.Tensor | None
    up: Any
    up_bias: torch.Tensor
    down: Any
    down_bias: torch.Tensor


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX: see the module docstring for how it differs from Llama."""

    # recomputed buffers older checkpoints store (the causal mask and rotary frequencies)
    ignored_weight_suffixes = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")

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
        hf = config.hf_config
        rope = hf.get("rope_parameters") or {}
        fraction = float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))
        self.rotary_dim = int(config.head_dim * fraction)
        self.parallel_residual = bool(hf.get("use_parallel_residual", True))
        self.gelu = GELU_APPROXIMATIONS[hf.get("hidden_act", "gelu")]
        self.q_size = config.num_heads * config.head_dim
        self.cos_sin_cache = build_cos_sin_cache(
            self.rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            self.device,
        )
        self.layers: list[_Layer] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: tuple[torch.Tensor, torch.Tensor] | None = None
        self.head: Any = None

    # --- what the loader asks of the class ----------------------------------------------------------

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The common keys as for Llama, plus GPT-NeoX's own names for the norm epsilon and rotary base.

        Raises:
            KeyError: a required key is missing.
            ValueError: an activation other than GELU.
        """
        config = ModelConfig.from_hf_dict(hf_config)
        if hf_config.get("hidden_act", "gelu") not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"hidden_act {hf_config['hidden_act']!r} is not one of {sorted(GELU_APPROXIMATIONS)}"
            )
        config.rms_norm_eps = float(hf_config.get("layer_norm_eps", 1e-5))  # the LayerNorm epsilon here
        if "rotary_emb_base" in hf_config:  # configs written before transformers 5
            config.rope_theta = float(hf_config["rotary_emb_base"])
        config.attention_bias = bool(hf_config.get("attention_bias", True))
        return config

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The tensors of a GPT-NeoX checkpoint, in HF's order."""
        h, inter, q = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
        shapes: dict[str, tuple[int, ...]] = {"gpt_neox.embed_in.weight": (config.vocab_size, h)}
        for i in range(config.num_layers):
            p = f"gpt_neox.layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (h,)
            shapes[p + "attention.query_key_value.weight"] = (3 * q, h)
            if config.attention_bias:
                shapes[p + "attention.query_key_value.bias"] = (3 * q,)
            shapes[p + "attention.dense.weight"] = (h, q)
            if config.attention_bias:
                shapes[p + "attention.dense.bias"] = (h,)
            shapes[p + "mlp.dense_h_to_4h.weight"] = (inter, h)
            shapes[p + "mlp.dense_h_to_4h.bias"] = (inter,)
            shapes[p + "mlp.dense_4h_to_h.weight"] = (h, inter)
            shapes[p + "mlp.dense_4h_to_h.bias"] = (h,)
        shapes["gpt_neox.final_layer_norm.weight"] = shapes["gpt_neox.final_layer_norm.bias"] = (h,)
        if not config.tie_word_embeddings:
            shapes["embed_out.weight"] = (config.vocab_size, h)
        return shapes

    # --- loading -------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Take the HF tensors, regroup q/k/v by projection, and hand every matrix to the GEMM backend.

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        cfg = self.config
        tensors = dict(weights)
        h, q, heads, hd = cfg.hidden_size, self.q_size, cfg.num_heads, cfg.head_dim

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = take_tensor(tensors, name, shape)
            return t.dequantize() if isinstance(t, QuantizedWeight) else t

        def vec(name: str, size: int) -> torch.Tensor:
            return take(name, (size,)).to(device=self.device, dtype=self.dtype)

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return vec(prefix + ".weight", h), vec(prefix + ".bias", h)

        def mat(t: torch.Tensor, projection: bool = True) -> Any:
            t = t.to(self.device)
            if projection and self.linear_quantizer is not None:
                return self.gemm.prepare_weight(self.linear_quantizer(t), self.dtype)
            return self.gemm.prepare_weight(t, self.dtype)

        def by_projection(t: torch.Tensor) -> torch.Tensor:
            # rows come as [head][q|k|v][head_dim]; the forward splits [q rows | k rows | v rows]
            return t.reshape(heads, 3, hd, *t.shape[1:]).transpose(0, 1).reshape(3 * q, *t.shape[1:])

        embed = take("gpt_neox.embed_in.weight", (cfg.vocab_size, h))
        self.embed = embed.to(device=self.device, dtype=self.dtype)
        for i in range(cfg.num_layers):
            p = f"gpt_neox.layers.{i}."
            qkv_bias = dense_bias = None
            if cfg.attention_bias:
                qkv_bias = by_projection(vec(p + "attention.query_key_value.bias", 3 * q))
                dense_bias = vec(p + "attention.dense.bias", h)
            self.layers.append(
                _Layer(
                    input_norm=norm(p + "input_layernorm"),
                    post_norm=norm(p + "post_attention_layernorm"),
                    qkv=mat(by_projection(take(p + "attention.query_key_value.weight", (3 * q, h)))),
                    qkv_bias=qkv_bias,
                    dense=mat(take(p + "attention.dense.weight", (h, q))),
                    dense_bias=dense_bias,
                    up=mat(take(p + "mlp.dense_h_to_4h.weight", (cfg.intermediate_size, h))),
                    up_bias=vec(p + "mlp.dense_h_to_4h.bias", cfg.intermediate_size),
                    down=mat(take(p + "mlp.dense_4h_to_h.weight", (h, cfg.intermediate_size))),
                    down_bias=vec(p + "mlp.dense_4h_to_h.bias", h),
                )
            )
        self.final_norm = norm("gpt_neox.final_layer_norm")
        head = embed if cfg.tie_word_embeddings else take("embed_out.weight", (cfg.vocab_size, h))
        self.head = mat(head, projection=False)  # the head stays unquantized: its logits pick the tokens

    # --- forward -------------------------------------------------------------------------------------

    def _layer_norm(self, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), params[0], params[1], self.config.rms_norm_eps)

    def _rotate(self, positions: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # rotate-half on the first rotary_dim channels of each head, in float32 as HF does; the rest pass
        cs = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)
        half = self.rotary_dim // 2
        cos, sin = cs[..., :half], cs[..., half:]
        x1, x2 = t[..., :half].float(), t[..., half : self.rotary_dim].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(t.dtype)
        return torch.cat((rotated, t[..., self.rotary_dim :]), dim=-1)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        up = F.gelu(self.gemm.linear(x, layer.up, layer.up_bias), approximate=self.gelu)
        return self.gemm.linear(up, layer.down, layer.down_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final LayerNorm, for a flat batch of tokens."""
        cfg, gemm = self.config, self.gemm
        n = input_ids.shape[0]
        hidden = self.embed.index_select(0, input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            qkv = gemm.linear(self._layer_norm(hidden, layer.input_norm), layer.qkv, layer.qkv_bias)
            q, k, v = (t.reshape(n, cfg.num_heads, cfg.head_dim) for t in qkv.split(self.q_size, dim=-1))
            attn = self.attention.forward(
                self._rotate(positions, q), self._rotate(positions, k), v, kv_cache, metadata
            )
            attn = gemm.linear(attn.reshape(n, self.q_size), layer.dense, layer.dense_bias)
            if self.parallel_residual:
                hidden = self._mlp(layer, self._layer_norm(hidden, layer.post_norm)) + attn + hidden
            else:
                hidden = attn + hidden
                hidden = self._mlp(layer, self._layer_norm(hidden, layer.post_norm)) + hidden
        return self._layer_norm(hidden, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` for the selected hidden rows."""
        return self.gemm.logits(hidden, self.head)
