"""Which second model speculative decoding runs beside the target (a draft model, an EAGLE head or the
checkpoint's MTP layer), loaded before the KV pools are sized and finished once they are."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.speculative.draft_setup import LoadedDraft, finish_draft, load_draft, wants_draft
from engine.speculative.eagle_setup import LoadedEagle, finish_eagle, load_eagle, wants_eagle
from engine.speculative.mtp_setup import LoadedMtp, finish_mtp, load_mtp, wants_mtp

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.interfaces.platform import Platform
    from engine.model_runner import ModelRunner
    from engine.models.config import ModelConfig
    from engine.models.registry import ModelRegistry
    from engine.speculative.draft_model import DraftParts
    from engine.speculative.eagle import EagleParts

#: a second model's weights, loaded (None: the method runs none)
LoadedProposer = LoadedDraft | LoadedEagle | LoadedMtp


def load_proposer(
    config: EngineConfig, platform: Platform, registry: ModelRegistry, target: Any, target_config: ModelConfig
) -> LoadedProposer | None:
    """The second model's weights, before the pools are sized: the target's pool leaves its room.

    Raises:
        EngineConfigError: as the method's own loader (a missing or mismatched model, an unsupported setup).
    """
    if wants_draft(config):
        return load_draft(config, platform, registry, target_config)
    if wants_eagle(config):
        return load_eagle(config, platform, target, target_config)
    if wants_mtp(config):
        return load_mtp(config, platform, target, target_config)
    return None


def finish_proposer(
    config: EngineConfig, platform: Platform, loaded: LoadedProposer | None, num_blocks: int, runner: ModelRunner
) -> DraftParts | EagleParts | None:
    """The second model's pool and runner, once the target's pool of ``num_blocks`` blocks is sized."""
    if isinstance(loaded, LoadedEagle):
        return finish_eagle(config, platform, loaded, num_blocks, runner)
    if isinstance(loaded, LoadedMtp):
        return finish_mtp(config, platform, loaded, num_blocks, runner)
    return finish_draft(config, platform, loaded, num_blocks) if loaded is not None else None
