"""Decoder base models (``Qwen3Model``, ``Qwen2Model``, ``LlamaModel``): the checkpoints of decoder
embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral), which hold the transformer without its LM head
and name their tensors without the ``model.`` prefix. They serve pooling requests only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

PREFIX = "model."


class HeadlessDecoder(DenseDecoder):
    """A causal LM's transformer without its LM head (embedding and classification checkpoints): it
    serves pooling requests only."""

    #: generation needs an LM head, which these checkpoints do not have
    generates: ClassVar[bool] = False

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The causal LM's config, its (absent) LM head tied to the embeddings."""
        config = super().config_from_hf(hf_config)
        config.tie_word_embeddings = True
        return config

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The causal LM's tensors without ``lm_head``."""
        return {name: shape for name, shape in super().weight_shapes(config).items() if name != "lm_head.weight"}


class _BaseModel(HeadlessDecoder):
    """The causal LM's transformer under its base-model names (no ``model.`` prefix)."""

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The headless tensors without the ``model.`` prefix."""
        return {name.removeprefix(PREFIX): shape for name, shape in super().weight_shapes(config).items()}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load under the causal LM's names."""
        super().load_weights((PREFIX + name, tensor) for name, tensor in weights)


class Qwen3Model(_BaseModel, Qwen3ForCausalLM):
    """``Qwen3Model`` (Qwen3-Embedding)."""


class Qwen2Model(_BaseModel, LlamaForCausalLM):
    """``Qwen2Model`` (gte-Qwen2)."""


class LlamaModel(_BaseModel, LlamaForCausalLM):
    """``LlamaModel``; Mistral-based embedding models (e5-mistral) save as ``MistralModel``, which reads the same."""
