"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

Importing this package imports neither torch nor a grammar library (``SamplingParams`` imports its
params); the xgrammar backend is built on the first constrained request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.structured_output.params import GrammarSpec, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.structured_output.backend import GrammarMatcher, StructuredOutputBackend
    from engine.structured_output.manager import StructuredOutputManager

__all__ = [
    "GrammarMatcher",
    "GrammarSpec",
    "StructuredOutputBackend",
    "StructuredOutputManager",
    "StructuredOutputsParams",
]

_LAZY = {
    "GrammarMatcher": "engine.structured_output.backend",
    "StructuredOutputBackend": "engine.structured_output.backend",
    "StructuredOutputManager": "engine.structured_output.manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine.structured_output' has no attribute {name!r}")
