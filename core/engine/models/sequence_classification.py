"""Decoder sequence classifiers (``Qwen2ForSequenceClassification``, ``LlamaForSequenceClassification``,
...): the causal LM's transformer with a ``score`` head on the last token's hidden state (rerankers,
classifiers, reward models). They serve pooling requests with ``task="classify"`` only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from engine.models.base_models import HeadlessDecoder
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

SCORE = "score.weight"


def num_labels(hf_config: dict[str, Any]) -> int:
    """The classifier's outputs: ``id2label``'s size, else ``num_labels`` (transformers' default 2)."""
    labels = hf_config.get("id2label")
    return len(labels) if labels else int(hf_config.get("num_labels", 2))


class _SequenceClassifier(HeadlessDecoder):
    """A decoder with a linear ``score`` head instead of the LM head."""

    default_pooling_type: ClassVar[str] = "LAST"

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The headless tensors, and ``score.weight`` ``[labels, hidden]``."""
        return {**super().weight_shapes(config), SCORE: (num_labels(config.hf_config), config.hidden_size)}

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
