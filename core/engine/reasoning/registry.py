"""Reasoning parsers by name, for ``--reasoning-parser NAME`` and ``--reasoning-parser-plugin FILE``.

A plugin file defines a :class:`~engine.reasoning.base.ReasoningParser` subclass (for ``<think>``-style
markers, subclass :class:`~engine.reasoning.think_tags.ThinkTagReasoningParser` and set its markers)
and registers it in a function the registry calls with itself::

    def register_reasoning_parsers(registry):
        registry.register("my_model", MyReasoningParser)
"""

from __future__ import annotations

from typing import Any

from engine.named_registry import NamedRegistry
from engine.reasoning.base import ReasoningParser
from engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.reasoning.gpt_oss import GptOssReasoningParser
from engine.reasoning.qwen3 import Qwen3ReasoningParser

#: the function a reasoning-parser plugin file defines; it is called with the registry
REASONING_PARSER_PLUGIN_HOOK = "register_reasoning_parsers"


class ReasoningParserRegistry(NamedRegistry[type[ReasoningParser]]):
    """Reasoning-parser classes by name; :func:`default_reasoning_parser_registry` makes one with the
    built-ins."""

    def __init__(self) -> None:
        super().__init__("reasoning parser", REASONING_PARSER_PLUGIN_HOOK)

    def register(
        self, name: str, entry: type[ReasoningParser], *, replace: bool = False
    ) -> type[ReasoningParser]:
        """Add a parser class under ``name``.

        Args:
            name: what ``--reasoning-parser`` selects it by.
            entry: a :class:`ReasoningParser` subclass.
            replace: allow taking over a registered name.

        Returns:
            ``entry``.

        Raises:
            TypeError: ``entry`` is not a ReasoningParser subclass.
            ValueError: the name is empty, has whitespace, or is taken and ``replace`` is False.
        """
        if not (isinstance(entry, type) and issubclass(entry, ReasoningParser)):
            raise TypeError(f"reasoning parser {name!r} must be a ReasoningParser subclass, got {entry!r}")
        return super().register(name, entry, replace=replace)

    def create(self, name: str, tokenizer: Any = None) -> ReasoningParser:
        """An instance of the parser registered under ``name``.

        Args:
            name: a registered name.
            tokenizer: the model's tokenizer.

        Returns:
            The parser.

        Raises:
            UnknownNameError: no parser has that name; the message lists the known ones.
        """
        return self.get(name)(tokenizer)


def default_reasoning_parser_registry() -> ReasoningParserRegistry:
    """A new registry holding the built-in parsers: deepseek_r1, openai_gptoss, qwen3."""
    registry = ReasoningParserRegistry()
    registry.register("deepseek_r1", DeepSeekR1ReasoningParser)
    registry.register("openai_gptoss", GptOssReasoningParser)
    registry.register("qwen3", Qwen3ReasoningParser)
    return registry
