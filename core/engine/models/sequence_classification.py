"""Decoder sequence classifiers (``Qwen2ForSequenceClassification``, ``LlamaForSequenceClassification``,
...): the causal LM's transformer with a ``score`` head on the last token's hidden state (rerankers,
classifiers, reward models). They serve pooling requests with ``task="classify"`` only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import DenseDecoder
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

SCORE = "score.weight"


def num_labels(hf_config: dict[str, Any]) -> int:
    """The classifier's outputs: ``id2label``'s size, else ``num_labels`` (transformers' default 2)."""
    labels = hf_config.get("id2label")
    return len(labels) if labels else int(hf_config.get("num_labels", 2))


class _SequenceClassifier(DenseDecoder):
    """A decoder with a linear ``score`` head instead of the LM head."""

    generates: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "LAST"

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The causal LM's config; the (absent) LM head is tied to the embeddings."""
        config = super().config_from_hf(hf_config)
        config.tie_word_embeddings = True
        return config

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The causal LM's tensors without ``lm_head``, and ``score.weight`` ``[labels, hidden]``."""
        shapes = {n: s for n, s in super().weight_shapes(config).items() if n != "lm_head.weight"}
        shapes[SCORE] = (num_labels(config.hf_config), config.hidden_size)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load the transformer, and keep the head in the model dtype."""
        found: list[torch.Tensor] = []

        def without_head() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name == SCORE:
                    found.append(torch.as_tensor(tensor))
                else:
                    yield name, tensor

        super().load_weights(without_head())
        self.score = found[0].to(device=self.device, dtype=self.dtype) if found else None

    def classification_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The labels' logits for a pooled hidden state (float32 ``[labels]``)."""
        assert self.score is not None
        return torch.nn.functional.linear(pooled.to(device=self.device, dtype=self.dtype), self.score).float()


class LlamaForSequenceClassification(_SequenceClassifier, LlamaForCausalLM):
    """``LlamaForSequenceClassification`` (also Qwen2's and Mistral's, which share its layout)."""


class Qwen3ForSequenceClassification(_SequenceClassifier, Qwen3ForCausalLM):
    """``Qwen3ForSequenceClassification``."""
