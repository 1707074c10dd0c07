"""The model hyper-parameters the core needs, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Qwen2's checkpoints (causal LM, base model, classifier): q/k/v biases without the config saying so
QWEN2_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2Model", "Qwen2ForSequenceClassification")


@dataclass(slots=True)
class ModelConfig:
    """Architecture and sizes of a decoder-only model (the fields the core and the Llama family use).

    Attributes:
        architecture: the HF ``architectures[0]`` name, e.g. ``"LlamaForCausalLM"``.
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: sizes.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        rope_scaling: HF ``rope_scaling`` dict (``linear`` and ``llama3`` types are honoured) or None.
        max_position_embeddings: the model's context length.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2).
        sliding_window: attention window, None for full attention.
        bos_token_id: beginning-of-sequence id, if any.
        eos_token_ids: ids that end generation.
        torch_dtype: the checkpoint's dtype name, e.g. ``"bfloat16"``.
        hf_config: the raw HF ``config.json`` dict, so that an architecture can read its own keys (for a
            GGUF file of a core kind, the HF keys its metadata stands for; empty for other GGUF kinds);
            not part of equality or the repr.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``."""
        archs = cfg.get("architectures") or [""]
        arch = archs[0]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
        attention_bias = bool(cfg.get("attention_bias", False)) or arch in QWEN2_ARCHITECTURES
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 keeps theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", ""),
            hf_config=dict(cfg),
        )
