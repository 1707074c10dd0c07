"""Hugging Face model folders: config.json, safetensors (single or sharded) or PyTorch .bin weights."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from engine.loader.architectures import registry_or_core
from engine.loader.errors import ModelLoadError
from engine.loader.lazy_tensor import LazyTensor, lazy_safetensors
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.models.registry import ModelRegistry

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

# Bytes per element of the safetensors dtype codes, to check that each tensor's byte range fits its shape.
SAFETENSORS_ITEM_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON object file, turning a syntax error into a one-line ModelLoadError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def load_hf_config(folder: str, registry: ModelRegistry | None = None) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json``'s stop ids) of a HF model folder.

    Args:
        folder: the model folder.
        registry: resolves ``architectures[0]`` to the class whose ``config_from_hf`` reads the file
            (default: the core's architectures only).

    Returns:
        The model config; ``eos_token_ids`` merges both files' ids, ``hf_config`` holds config.json.

    Raises:
        ModelLoadError: no config.json, invalid JSON, a missing field, or an unsupported architecture.
    """
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"model folder {folder} has no {CONFIG_FILE}")
    raw = read_json(path)
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_class = registry_or_core(registry).resolve(arch, path)
    try:
        config = model_class.config_from_hf(raw)
    except KeyError as err:
        raise ModelLoadError(f"{path} lacks the field {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{path} has an invalid value: {err}") from None
    if not config.hf_config:
        config.hf_config = raw
    gen_path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if os.path.isfile(gen_path):
        eos = read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        config.eos_token_ids += [int(e) for e in extra if int(e) not in config.eos_token_ids]
    return config


def find_weight_files(folder: str) -> list[str]:
    """List a HF folder's weight files, shards in order.

    Args:
        folder: the model folder.

    Returns:
        Absolute paths of ``.safetensors`` files, or of ``.bin`` files when there are no safetensors.

    Raises:
        ModelLoadError: no weight files, or an index naming a shard that is not there.
    """
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        index_path = os.path.join(folder, index_name)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError(f"{index_path} has no 'weight_map'")
            files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
            for file in files:
                if not os.path.isfile(file):
                    raise ModelLoadError(f"shard {file} named by {index_path} is missing")
            return files
    for name in (SAFETENSORS_FILE, TORCH_BIN_FILE):
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise ModelLoadError(f"model folder {folder} has no weights ({SAFETENSORS_FILE} or {TORCH_BIN_FILE})")


def check_safetensors_file(path: str) -> None:
    """Check a safetensors file's header against its size, so a truncated download fails early.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        ModelLoadError: the header is unreadable or a tensor's bytes lie beyond the end of the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"safetensors file {path} is truncated (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise ModelLoadError(
                f"safetensors file {path} is truncated or corrupt (header runs past the end)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelLoadError(f"safetensors file {path} is corrupt (its header is not JSON)") from None
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            item_size = SAFETENSORS_ITEM_SIZES.get(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"safetensors file {path} is corrupt (bad entry for '{name}')") from None
        if end > data_size:
            raise ModelLoadError(
                f"safetensors file {path} is truncated: tensor '{name}' ends at byte {end} "
                f"of a {data_size}-byte data section"
            )
        if item_size is not None and end - begin != numel * item_size:
            raise ModelLoadError(f"safetensors file {path} is corrupt (tensor '{name}' has the wrong size)")


def check_hf_weights(folder: str) -> None:
    """Check that a HF folder has weight files and that its safetensors headers fit their files.

    Raises:
        ModelLoadError: as :func:`find_weight_files` and :func:`check_safetensors_file`.
    """
    for file in find_weight_files(folder):
        if file.endswith(".safetensors"):
            check_safetensors_file(file)
        elif os.path.getsize(file) == 0:
            raise ModelLoadError(f"weight file {file} is empty")


def iter_hf_weights(
    folder: str, config: ModelConfig, model_class: type[CausalLM], lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield a HF folder's tensors by HF name, in checkpoint dtype, on the CPU.

    Tensors the model class ignores are skipped: recomputed buffers such as ``rotary_emb.inv_freq``, and
    for Llama the ``lm_head.weight`` copy some tied checkpoints store.

    Args:
        folder: the model folder.
        config: its model config.
        model_class: the resolved model class (its ``ignores_weight`` filters the stream).
        lazy: yield safetensors tensors unread (:class:`LazyTensor`), for a loader that reads only the
            slices it keeps (tensor-parallel ranks); other weight files are read whole either way.

    Raises:
        ModelLoadError: a weight file cannot be read.
    """
    for file in find_weight_files(folder):
        for name, tensor in _read_weight_file(file, lazy):
            if model_class.ignores_weight(name, config):
                continue
            yield name, tensor


def _read_weight_file(file: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    if file.endswith(".safetensors"):
        check_safetensors_file(file)
        try:
            if lazy:
                yield from lazy_safetensors(file)
                return
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        except SafetensorError as err:
            raise ModelLoadError(f"cannot read safetensors file {file}: {err}") from None
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        raise ModelLoadError(f"cannot read weight file {file}: {_torch_load_reason(err)}") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"weight file {file} does not hold a state dict")
    yield from state.items()


#: lines of torch's weights-only refusal that are advice, not the reason
_TORCH_LOAD_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")


def _torch_load_reason(err: BaseException) -> str:
    """What ``torch.load`` found wrong, in one line.

    Its weights-only refusal is a paragraph of advice around one line of reason (an unsupported global,
    a bad opcode); that line is kept, with a word on why only plain state dicts are loaded.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, pickle.UnpicklingError):
        reasons = [line for line in lines if not line.startswith(_TORCH_LOAD_ADVICE)]
        reason = reasons[-1] if reasons else "not a plain state dict"
        reason = reason.removeprefix("WeightsUnpickler error:").strip() or "not a plain state dict"
        return f"{reason} (only tensors are unpickled, so a file that holds code or other objects is refused)"
    return " ".join(" ".join(lines).split()) or type(err).__name__
