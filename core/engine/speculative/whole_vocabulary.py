"""The target's whole embedding table and LM head for a proposer that runs on the driver alone beside a
tensor-parallel target (an EAGLE head): each rank holds only its slice of both, and looking a token up in
a slice would take the other ranks' part in a collective they never join."""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import EngineConfigError
from engine.loader import resolve_model_path
from engine.loader.errors import ModelLoadError
from engine.loader.hf_folder import iter_hf_weights
from engine.loader.lazy_tensor import materialize
from engine.loader.weight_slices import dense
from engine.models.config import ModelConfig

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def load_whole_vocabulary(config: EngineConfig, target: Any, target_config: ModelConfig, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the target's embedding table and LM head whole from its HF folder, in the target's dtype on
    its device (only these two tensors are read).

    Args:
        config: the engine configuration (the target's path and load format).
        target: the loaded target model (its dtype, device and class).
        target_config: the target's config.
        where: the setting the errors name.

    Returns:
        ``(embeddings [vocab, hidden], LM head [vocab, hidden])``; the same tensor twice for tied ones.

    Raises:
        EngineConfigError: in one line: the target is not an HF folder, or the tensors cannot be read.
    """
    path = resolve_model_path(config.model)
    if config.load_format == "dummy" or not os.path.isdir(path):
        raise EngineConfigError(
            f"{where} under tensor parallelism reads the target's whole embeddings from its HF folder (not a GGUF file or dummy weights)"
        )
    shape = (target_config.vocab_size, target_config.hidden_size)
    try:
        wanted = {name: t for name, t in iter_hf_weights(path, target_config, type(target), lazy=True) if name in (EMBED, LM_HEAD)}
        if EMBED not in wanted:
            raise ModelLoadError(f"no {EMBED} in {path}")
        tensors = {name: dense(materialize(t)).to(device=target.device, dtype=target.dtype) for name, t in wanted.items()}
    except (ModelLoadError, OSError, ValueError) as exc:
        raise EngineConfigError(f"{where}: the target's embeddings: {exc}") from None
    embed = tensors[EMBED]
    head = embed if target_config.tie_word_embeddings or LM_HEAD not in tensors else tensors[LM_HEAD]
    for name, t in ((EMBED, embed), (LM_HEAD, head)):
        if tuple(t.shape) != shape:
            raise EngineConfigError(f"{where}: the target's {name} is {tuple(t.shape)}, not {shape}")
    return embed, head
