"""Pooling requests: embeddings of a prompt's hidden states (``PoolingParams``), computed by the same
scheduler and runner as generation, with no token sampled."""

from __future__ import annotations

from engine.pooling.params import PoolingParams

__all__ = ["PoolingParams"]
