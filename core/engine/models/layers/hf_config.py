"""Reading the keys the Hub spells in several ways: RoPE parameters, layer types, sliding windows.

transformers < 5 writes top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` /
``rope_local_base_freq``; transformers 5 writes ``rope_parameters``, flat or keyed by layer type
(``{"full_attention": {...}, "sliding_attention": {...}}``). Both are read here.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def rope_parameters(hf: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of one layer type, with ``rope_type``, ``rope_theta`` and ``partial_rotary_factor``.

    Args:
        hf: the parsed ``config.json``.
        layer_type: ``full_attention`` / ``sliding_attention`` for configs with per-type parameters.

    Returns:
        A new dict; ``rope_theta`` falls back to 10000 and ``partial_rotary_factor`` to 1.
    """
    params: dict[str, Any] = {}
    nested = hf.get("rope_parameters")
    if isinstance(nested, dict):
        if layer_type is not None and isinstance(nested.get(layer_type), dict):
            params.update(nested[layer_type])
        elif FULL in nested or SLIDING in nested:
            params.update(nested.get(FULL) or {})
        else:
            params.update(nested)
    if isinstance(hf.get("rope_scaling"), dict) and params.get("rope_type", "default") == "default":
        params.update(hf["rope_scaling"])
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    if hf.get("rope_theta") is not None and "rope_theta" not in params:
        params["rope_theta"] = hf["rope_theta"]
    if hf.get("partial_rotary_factor") is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    if params.get("rope_type") in ("longrope", "yarn") and "original_max_position_embeddings" not in params:
        original = hf.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("partial_rotary_factor", 1.0)
    return params


def scaling_of(params: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling part of :func:`rope_parameters`' result, None for plain RoPE."""
    return None if params.get("rope_type", "default") == "default" else params


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The configured window, None when absent, zero, or switched off by ``use_sliding_window: false``."""
    if hf.get("use_sliding_window") is False:
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


def layer_types(hf: dict[str, Any], num_layers: int, default: list[str] | None = None) -> list[str]:
    """Each layer's ``full_attention`` / ``sliding_attention`` type.

    Args:
        hf: the parsed ``config.json``.
        num_layers: the number of layers.
        default: the family's pattern when the config has no ``layer_types`` (all full if None).

    Returns:
        One type per layer.

    Raises:
        ValueError: a ``layer_types`` list of the wrong length.
    """
    types = hf.get("layer_types") or default or [FULL] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return list(types)


def layer_windows(hf: dict[str, Any], num_layers: int, default: list[str] | None = None) -> list[int | None]:
    """Each layer's attention window from :func:`layer_types` and :func:`sliding_window` (None: global).

    Args:
        hf: the parsed ``config.json``.
        num_layers: the number of layers.
        default: the family's layer types when the config lists none.

    Returns:
        One window (or None) per layer.
    """
    window = sliding_window(hf)
    return [window if t == SLIDING else None for t in layer_types(hf, num_layers, default)]
