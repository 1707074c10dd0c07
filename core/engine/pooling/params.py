"""What a pooling (embedding) request asks for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: ``LAST``: the last token's hidden state (decoder embedding models); ``MEAN``: the prompt's average;
#: ``CLS``: the first token's; ``ALL``: every token's (one row each); ``STEP``: the rows of the tokens equal
#: to ``step_tag_id`` (process reward models score each reasoning step at its tag)
PoolingType = Literal["LAST", "MEAN", "CLS", "ALL", "STEP"]
#: the pooling types that return one row per (selected) token rather than one vector
PER_TOKEN_POOLING = ("ALL", "STEP")


class PoolingParams(BaseModel):
    """How to turn a prompt's final hidden states into one vector.

    Attributes:
        pooling_type: None: the model's own (its sentence-transformers pooling config, else ``LAST``).
        normalize: scale to unit length; None: the model's own (sentence-transformers' ``Normalize``
            module, else True).
        dimensions: keep the first ``dimensions`` values (Matryoshka embeddings), before normalizing.
        task: ``embed``: the pooled vector; ``classify``: the model's classification head on it (a
            sequence-classification, reranker or reward model), its logits turned into probabilities
            unless ``activation`` is off.
        activation: for ``classify``: softmax over the labels, or a sigmoid for a single label
            (sentence-transformers' cross-encoders); False keeps the raw logits (reward models).
        step_tag_id: for ``STEP``: the token whose rows are kept (None: every row, as ``ALL``).
        returned_token_ids: for ``ALL`` and ``STEP``: keep these columns of each row (of the head's
            logits for ``classify``, before the activation; of the hidden state for ``embed``).
    """

    model_config = ConfigDict(extra="forbid")

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = Field(None, ge=1)
    task: Literal["embed", "classify"] = "embed"
    activation: bool = True
    step_tag_id: int | None = Field(None, ge=0)
    returned_token_ids: list[int] | None = None

    @property
    def per_token(self) -> bool:
        """Whether the result is one row per (selected) prompt token."""
        return self.pooling_type in PER_TOKEN_POOLING
