"""Checks of a pooling request's per-token settings, before it is queued."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.pooling.params import PoolingParams


def num_labels(hf_config: dict[str, Any]) -> int:
    """A sequence-classification checkpoint's label count (``id2label``, else ``num_labels``, else 2)."""
    return len(hf_config.get("id2label") or {}) or int(hf_config.get("num_labels", 2))


def check_per_token_params(params: PoolingParams, hidden_size: int, hf_config: dict[str, Any]) -> None:
    """Refuse ``step_tag_id`` / ``returned_token_ids`` that the pooling type does not use, and columns past
    the row's width (the hidden size, or the labels for ``classify``).

    Raises:
        InvalidRequestError: naming the field.
    """
    if params.step_tag_id is not None and params.pooling_type != "STEP":
        raise InvalidRequestError("step_tag_id needs pooling_type STEP", param="step_tag_id")
    columns = params.returned_token_ids
    if columns is None:
        return
    if not params.per_token:
        raise InvalidRequestError("returned_token_ids needs pooling_type ALL or STEP", param="returned_token_ids")
    width = num_labels(hf_config) if params.task == "classify" else hidden_size
    bad = [c for c in columns if not 0 <= c < width]
    if bad or not columns:
        what = "labels" if params.task == "classify" else "hidden size"
        raise InvalidRequestError(f"returned_token_ids must be columns in [0, {width}) (the model's {what}); got {columns}", param="returned_token_ids")
