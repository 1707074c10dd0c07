"""What a pooling (embedding) request asks for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: ``LAST``: the last token's hidden state (decoder embedding models); ``MEAN``: the prompt's average;
#: ``CLS``: the first token's
PoolingType = Literal["LAST", "MEAN", "CLS"]


class PoolingParams(BaseModel):
    """How to turn a prompt's final hidden states into one vector.

    Attributes:
        pooling_type: None: the model's own (its sentence-transformers pooling config, else ``LAST``).
        normalize: scale to unit length; None: the model's own (sentence-transformers' ``Normalize``
            module, else True).
        dimensions: keep the first ``dimensions`` values (Matryoshka embeddings), before normalizing.
    """

    model_config = ConfigDict(extra="forbid")

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = Field(None, ge=1)
