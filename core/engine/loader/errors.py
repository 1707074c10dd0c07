"""The one error type the loader raises for a model it cannot use."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path, config or weight file the engine cannot load; ``str(err)`` is a one-line message
    meant for the user, naming the file and what is wrong with it."""
