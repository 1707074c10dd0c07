"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into host
tensors, each module's scale worked out as PEFT applies it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.lora.request import LoRARequest

#: the prefix PEFT writes before a module's path in the base model
PEFT_PREFIX = "base_model.model."
#: ``{module}.lora_A.weight`` (an adapter name may sit before ``.weight``); an embedding's parts are saved
#: as ``{module}.lora_embedding_A`` without the suffix
_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.(?!weight$)[A-Za-z0-9_]+)?(?:\.weight)?$"
)
_EMBEDDING_PARTS = {"lora_embedding_A": "lora_A", "lora_embedding_B": "lora_B"}
#: a copy of a targeted layer's base weight, which PEFT saves beside an embedding's or lm_head's adapter
_BASE_LAYER = re.compile(r"^(?P<module>.+)\.base_layer\.weight$")


class LoraLoadError(ValueError):
    """An adapter that cannot be used: its message is one line naming the problem."""


@dataclass(slots=True)
class LoraModule:
    """One targeted module: ``delta_W = scale * b @ a``.

    Attributes:
        a: ``[r, in_features]`` (float32, on the host).
        b: ``[out_features, r]``.
        scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under rsLoRA, with the config's patterns.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class LoraAdapter:
    """An adapter in host memory.

    Attributes:
        request: how it was asked for.
        modules: the base model's module path (``model.layers.0.self_attn.q_proj``) -> its update.
        base_layers: shapes of base weights PEFT saved with the adapter (an embedding's or lm_head's).
    """

    request: LoRARequest
    modules: dict[str, LoraModule]
    #: shapes of the base weights saved with it (module path -> shape): they must be the model's own
    base_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: a key matches a module path it ends (as whole path
    components) or, being a regular expression, fully matches such an ending."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked for what this engine runs.

    Raises:
        LoraLoadError: missing, not JSON, not a LoRA adapter, or using a PEFT feature this engine lacks.
    """
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoraLoadError(f"{folder} has no adapter_config.json (a PEFT LoRA adapter folder is expected)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"{path} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraLoadError(f"{path}: peft_type {peft_type!r} is not a LoRA adapter")
    if config.get("use_dora"):
        raise LoraLoadError(f"{path}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"{path}: adapters that train biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoraLoadError(f"{path}: adapters with fully trained modules (modules_to_save={config['modules_to_save']}) are not supported")
    if config.get("fan_in_fan_out"):
        raise LoraLoadError(f"{path}: fan_in_fan_out adapters (Conv1D layers) are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoraLoadError(f"{path}: {key} must be a positive number, got {value!r}")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_path = folder / "adapter_model.safetensors"
    bin_path = folder / "adapter_model.bin"
    if safetensors_path.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise LoraLoadError(f"{safetensors_path} cannot be read: {exc}") from None
    if bin_path.is_file():
        try:
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError) as exc:
            raise LoraLoadError(f"{bin_path} cannot be read: {exc}") from None
        if not isinstance(tensors, dict):
            raise LoraLoadError(f"{bin_path} does not hold a dict of tensors")
        return tensors
    raise LoraLoadError(f"{folder} has neither adapter_model.safetensors nor adapter_model.bin")


def load_peft_adapter(request: LoRARequest) -> LoraAdapter:
    """Read an adapter's tensors into host memory (float32) with each module's scale.

    Raises:
        LoraLoadError: the folder, its config or its tensors are missing, malformed or inconsistent.
    """
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise LoraLoadError(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} is not a folder")
    config = read_adapter_config(folder)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    base_layers: dict[str, tuple[int, ...]] = {}
    for key, tensor in _read_tensors(folder).items():
        base = _BASE_LAYER.match(key)
        if base is not None:
            base_layers[base["module"].removeprefix(PEFT_PREFIX)] = tuple(tensor.shape)
            continue
        match = _KEY.match(key)
        if match is None:
            raise LoraLoadError(f"LoRA adapter {request.lora_name!r}: unexpected tensor {key!r}")
        module = match["module"].removeprefix(PEFT_PREFIX)
        part = match["part"]
        if part in _EMBEDDING_PARTS:
            # PEFT stores an embedding's A as [r, vocab] and B as [hidden, r]: the same roles as a linear's
            part = _EMBEDDING_PARTS[part]
        parts.setdefault(module, {})[part] = tensor
    if not parts:
        raise LoraLoadError(f"LoRA adapter {request.lora_name!r} holds no LoRA tensors")
    default_r, default_alpha = config.get("r", 8), config.get("lora_alpha", 8)
    modules: dict[str, LoraModule] = {}
    for module, found in sorted(parts.items()):
        if set(found) != {"lora_A", "lora_B"}:
            raise LoraLoadError(f"LoRA adapter {request.lora_name!r}: {module} lacks its {'lora_B' if 'lora_A' in found else 'lora_A'} tensor")
        a, b = found["lora_A"], found["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraLoadError(f"LoRA adapter {request.lora_name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, whose ranks differ")
        r = _pattern_value(config.get("rank_pattern") or {}, module, default_r)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, default_alpha)
        if r != a.shape[0]:
            raise LoraLoadError(f"LoRA adapter {request.lora_name!r}: {module} has rank {a.shape[0]}, its config says {r}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[module] = LoraModule(a.float().contiguous(), b.float().contiguous(), float(scale))
    return LoraAdapter(request, modules, base_layers)
