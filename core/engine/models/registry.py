"""The one model registry: HF architecture name -> :class:`CausalLM` subclass, core models plus plugins'.

A registry is built per engine (or per loader call), never kept in a global: :meth:`ModelRegistry.core`
holds the core's architectures, :meth:`ModelRegistry.from_plugins` adds every plugin's
``engine_register_models()``. Every loader path (HF folders, GGUF files, dummy weights, the weight-stream
check) resolves the architecture through it.

A plugin may add architectures but never replace one: a name the core (or an earlier plugin, in
entry-point name order) already registered is refused with a :class:`ModelRegistryWarning` naming both,
and the first registration stays. A plugin that wants different behaviour for a core architecture
registers its class under a new name (and a checkpoint names that architecture in its config.json).
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from engine.loader.errors import ModelLoadError
from engine.models.base import CausalLM
from engine.models.base_models import LlamaModel, Qwen2Model, Qwen3Model
from engine.models.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from engine.models.cohere import CohereForCausalLM
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.glm import Glm4ForCausalLM, GlmForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.modernbert import ModernBertForSequenceClassification, ModernBertModel
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.sequence_classification import (
    LlamaForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from engine.models.smollm3 import SmolLM3ForCausalLM
from engine.models.stablelm import StableLmForCausalLM

if TYPE_CHECKING:
    from engine.plugins.manager import PluginManager

#: the source name of the core's own architectures in messages and :attr:`ModelRegistry.sources`
CORE_SOURCE = "core"


#: the core's architectures, in the order messages list them
CORE_MODELS: tuple[tuple[str, type[CausalLM]], ...] = (
    ("LlamaForCausalLM", LlamaForCausalLM),
    ("MistralForCausalLM", LlamaForCausalLM),
    ("Qwen2ForCausalLM", LlamaForCausalLM),
    ("Qwen3ForCausalLM", Qwen3ForCausalLM),
    ("GraniteForCausalLM", GraniteForCausalLM),
    ("Olmo2ForCausalLM", Olmo2ForCausalLM),
    ("Phi3ForCausalLM", Phi3ForCausalLM),
    ("Gemma2ForCausalLM", Gemma2ForCausalLM),
    ("Gemma3ForCausalLM", Gemma3ForCausalLM),
    ("GlmForCausalLM", GlmForCausalLM),
    ("Glm4ForCausalLM", Glm4ForCausalLM),
    ("SmolLM3ForCausalLM", SmolLM3ForCausalLM),
    ("StableLmForCausalLM", StableLmForCausalLM),
    ("CohereForCausalLM", CohereForCausalLM),
    ("MixtralForCausalLM", MixtralForCausalLM),
    ("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM),
    ("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM),
    ("OlmoeForCausalLM", OlmoeForCausalLM),
    ("Glm4MoeForCausalLM", Glm4MoeForCausalLM),
    ("GptOssForCausalLM", GptOssForCausalLM),
    ("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM),
    ("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM),
    # decoder base models: embedding checkpoints (pooling only)
    ("Qwen3Model", Qwen3Model),
    ("Qwen2Model", Qwen2Model),
    ("LlamaModel", LlamaModel),
    ("MistralModel", LlamaModel),
    # sequence classifiers: rerankers, classifiers and reward models (pooling with a head)
    ("LlamaForSequenceClassification", LlamaForSequenceClassification),
    ("Qwen2ForSequenceClassification", LlamaForSequenceClassification),
    ("MistralForSequenceClassification", LlamaForSequenceClassification),
    ("Qwen3ForSequenceClassification", Qwen3ForSequenceClassification),
    # encoders (bidirectional attention): embeddings and cross-encoder rerankers
    ("BertModel", BertModel),
    ("BertForSequenceClassification", BertForSequenceClassification),
    ("XLMRobertaModel", XLMRobertaModel),
    ("XLMRobertaForSequenceClassification", XLMRobertaForSequenceClassification),
    ("ModernBertModel", ModernBertModel),
    ("ModernBertForSequenceClassification", ModernBertForSequenceClassification),
)


class ModelRegistryWarning(UserWarning):
    """A plugin's model was not registered (a name already taken, or not a :class:`CausalLM`)."""


@dataclass(frozen=True)
class ModelRegistry:
    """Architecture name -> model class, and where each came from.

    Attributes:
        classes: HF ``architectures`` name -> :class:`CausalLM` subclass, core names first.
        sources: the same names -> ``"core"`` or the plugin's name.
        refused: one line per plugin entry that was not registered, and why.
    """

    classes: Mapping[str, type[CausalLM]]
    sources: Mapping[str, str]
    refused: tuple[str, ...] = field(default=())

    @classmethod
    def core(cls) -> ModelRegistry:
        """The core's architectures only (what a loader call without a registry uses)."""
        return cls.build()

    @classmethod
    def from_plugins(cls, plugin_manager: PluginManager) -> ModelRegistry:
        """The core's architectures plus those of every loaded plugin of ``plugin_manager``."""
        return cls.build(plugin_manager.models_by_plugin())

    @classmethod
    def build(cls, plugin_models: Iterable[tuple[str, Mapping[str, Any]]] = ()) -> ModelRegistry:
        """Register the core's models, then each plugin's, refusing overrides.

        Args:
            plugin_models: ``(plugin name, {architecture: class})`` pairs, in the order they register.

        Returns:
            The registry. Refused entries are listed in :attr:`refused` and each is warned about once
            with a :class:`ModelRegistryWarning` naming the plugin, the class and the name's owner.
        """
        classes: dict[str, type[CausalLM]] = {}
        sources: dict[str, str] = {}
        for name, model_cls in CORE_MODELS:
            classes[name], sources[name] = model_cls, CORE_SOURCE
        refused: list[str] = []
        for plugin, models in plugin_models:
            for name, model_cls in (models or {}).items():
                problem = ""
                if not (isinstance(model_cls, type) and issubclass(model_cls, CausalLM)):
                    problem = f"{model_cls!r} is not a subclass of engine_plugin_sdk.models.CausalLM"
                elif name in classes:
                    owner = "the core" if sources[name] == CORE_SOURCE else f"plugin {sources[name]!r}"
                    problem = (
                        f"{name!r} is already registered by {owner} as {_qualname(classes[name])}; "
                        f"{_qualname(model_cls)} would replace it, and plugins may only add architectures"
                    )
                if problem:
                    refused.append(f"plugin {plugin!r}: model {name!r} refused: {problem}")
                    warnings.warn(refused[-1], ModelRegistryWarning, stacklevel=2)
                    continue
                classes[name], sources[name] = model_cls, plugin
        return cls(MappingProxyType(classes), MappingProxyType(sources), tuple(refused))

    # --- lookups --------------------------------------------------------------------------------------

    def __contains__(self, architecture: object) -> bool:
        return architecture in self.classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.classes)

    def supported(self) -> list[str]:
        """Every registered architecture name, the core's first."""
        return list(self.classes)

    def resolve(self, architecture: str | None, source: str) -> type[CausalLM]:
        """The class registered for ``architecture``.

        Args:
            architecture: a HF ``architectures`` name (None when a config names none).
            source: the file it came from, for the message.

        Returns:
            The model class.

        Raises:
            ModelLoadError: the name is not registered; the message names the closest supported names
                (:func:`closest_architectures`) and lists every one.
        """
        model_cls = self.classes.get(architecture or "")
        if model_cls is None:
            raise ModelLoadError(
                f"unsupported architecture '{architecture}' in {source}; "
                f"{_supported_names(architecture or '', list(self.classes))}"
            )
        return model_cls

    def gguf_architectures(self) -> dict[str, str]:
        """GGUF ``general.architecture`` value -> HF name, for the registered classes that load GGUF."""
        kinds: dict[str, str] = {}
        for name, model_cls in self.classes.items():
            for kind, hf_name in model_cls.gguf_architectures.items():
                # a kind maps to a name this registry resolves to the class declaring it, first one wins
                if hf_name == name and kind not in kinds:
                    kinds[kind] = hf_name
        return kinds

    def resolve_gguf(self, gguf_architecture: str, source: str) -> str:
        """The HF architecture name a GGUF file of ``gguf_architecture`` loads as.

        Args:
            gguf_architecture: the file's ``general.architecture``.
            source: the file, for the message.

        Returns:
            A registered HF architecture name.

        Raises:
            ModelLoadError: no registered class loads this GGUF architecture; the message lists those that do.
        """
        kinds = self.gguf_architectures()
        if gguf_architecture not in kinds:
            raise ModelLoadError(
                f"unsupported architecture '{gguf_architecture}' in GGUF file {source}; "
                f"{_supported_names(gguf_architecture, list(kinds))} (as {', '.join(dict.fromkeys(kinds.values()))})"
            )
        return kinds[gguf_architecture]


def closest_architectures(architecture: str, supported: list[str], n: int = 3) -> list[str]:
    """The ``supported`` names most like ``architecture``, closest first (none when nothing is close).

    Names are compared without their ``For...`` ending (``ForCausalLM``, ``ForConditionalGeneration``) and
    case, so ``Qwen3NextForCausalLM`` finds ``Qwen3ForCausalLM`` rather than every name that ends alike.

    Args:
        architecture: the name that was not found (a HF class name or a GGUF kind).
        supported: the registered names.
        n: at most this many.

    Returns:
        Up to ``n`` names of ``supported``.
    """
    stems: dict[str, str] = {}
    for name in supported:
        stems.setdefault(_stem(name), name)
    return [stems[stem] for stem in difflib.get_close_matches(_stem(architecture), list(stems), n=n, cutoff=0.5)]


def _stem(name: str) -> str:
    # "Gemma3ForConditionalGeneration" -> "gemma3", "GPT2LMHeadModel" -> "gpt2": the family, not the head,
    # tells models apart
    return re.sub(r"(For[A-Z]\w*|LMHeadModel)$", "", name).lower()


def _supported_names(architecture: str, supported: list[str]) -> str:
    """``closest supported: A, B; all: ...`` (or ``supported: ...`` when none is close), for messages."""
    closest = closest_architectures(architecture, supported)
    everything = ", ".join(supported)
    return f"closest supported: {', '.join(closest)}; all: {everything}" if closest else f"supported: {everything}"


def _qualname(model_cls: type) -> str:
    return f"{model_cls.__module__}.{model_cls.__qualname__}"
