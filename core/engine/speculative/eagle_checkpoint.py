"""What an EAGLE head's folder says about it: its kind, its sizes and what it reads of the target.

Published heads are a ``config.json`` (a Llama config of one layer) next to their weights:

- EAGLE-1 (``yuhuili/EAGLE-LLaMA3-Instruct-8B``, the leading engine's ``EagleLlamaForCausalLM``):
  ``fc.weight`` ``[hidden, 2 * hidden]`` (and ``fc.bias`` where the head was trained with one),
  ``layers.0.*`` a Llama decoder layer without ``input_layernorm``; the embeddings and the LM head are
  the target's (a stored ``embed_tokens.weight`` is the target's frozen copy). It reads the target's last
  hidden state, after its final norm (the rows the target's LM head reads).
- EAGLE-3 (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, ``Eagle3LlamaForCausalLM``): ``fc.weight``
  ``[hidden, 3 * target hidden]`` over three target layers' inputs (the residual stream before layers
  ``2``, ``L // 2`` and ``L - 3`` unless the config names them), ``midlayer.*`` a decoder layer whose
  attention reads ``2 * hidden`` (its ``input_layernorm`` normalises the embeddings, ``hidden_norm`` the
  hidden state), ``norm.weight``, its own ``lm_head.weight`` over ``draft_vocab_size`` tokens and ``d2t``,
  each draft token's offset to its target id.
"""

from __future__ import annotations

import os
from typing import Any

from engine.loader.errors import ModelLoadError
from engine.loader.hf_folder import read_json
from engine.models.config import ModelConfig
from engine.models.eagle_head import EagleHeadConfig, EagleKind


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none: 2, L // 2 and L - 3 (the
    leading engine's and the EAGLE authors' choice), in layer order, each once."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def _configured_aux_layers(hf: dict[str, Any]) -> list[int] | None:
    eagle = hf.get("eagle_config")
    found = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    found = found if found is not None else hf.get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in found] if found is not None else None


def read_eagle_config(path: str, kind: EagleKind, target: ModelConfig) -> EagleHeadConfig:
    """Read and check the head's ``config.json`` against the target.

    Args:
        path: the head's folder.
        kind: the method asked for (``eagle`` or ``eagle3``).
        target: the target model's config.

    Returns:
        The head's config; its ``max_position_embeddings`` is raised to the target's (the head's rotary
        runs at the target's positions).

    Raises:
        ModelLoadError: the folder or its config cannot be read, or the head cannot serve this target
            (every reason listed, in one line).
    """
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path} is not a folder (an EAGLE head is a folder with config.json and its weights)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json")
    hf = read_json(config_path)
    try:
        model = ModelConfig.from_hf_dict(hf)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{config_path} is not a Llama config: missing or bad {err}") from None
    problems: list[str] = []
    if model.hidden_size != target.hidden_size:
        problems.append(f"its hidden size {model.hidden_size} differs from the target's {target.hidden_size}")
    if model.num_layers != 1:
        problems.append(f"it has {model.num_layers} layers; EAGLE heads of one layer are supported")
    if model.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary ({model.vocab_size}) differs from the target's ({target.vocab_size})")
    if model.sliding_window is not None:
        problems.append("its layer has a sliding window, which EAGLE heads do not")
    target_hidden = int(hf.get("target_hidden_size") or model.hidden_size)
    if target_hidden != target.hidden_size:
        problems.append(f"its target_hidden_size {target_hidden} differs from the target's {target.hidden_size}")
    aux: tuple[int, ...] = ()
    draft_vocab = model.vocab_size
    if kind == "eagle3":
        configured = _configured_aux_layers(hf)
        aux = tuple(sorted(set(configured))) if configured is not None else default_aux_layers(target.num_layers)
        if len(aux) != 3 or aux[0] < 0 or aux[-1] >= target.num_layers:
            named = configured if configured is not None else f"2, L // 2, L - 3 for L = {target.num_layers}"
            problems.append(
                f"it reads target layers {named}: three distinct layers of the target's {target.num_layers} are needed "
                "(set eagle_aux_hidden_state_layer_ids in its config for a target this shallow)"
            )
        draft_vocab = int(hf.get("draft_vocab_size") or model.vocab_size)
        eagle = hf.get("eagle_config")
        if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
            problems.append("it sets use_aux_hidden_state false, which is not supported")
    if problems:
        raise ModelLoadError("; ".join(problems))
    model.max_position_embeddings = max(model.max_position_embeddings, target.max_position_embeddings)
    return EagleHeadConfig(
        kind=kind,
        model=model,
        path=path,
        aux_layers=aux,
        draft_vocab_size=draft_vocab,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )
