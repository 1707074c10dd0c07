"""Tool parsers by name, for ``--tool-parser NAME`` and ``--tool-parser-plugin FILE``.

A plugin file defines a :class:`~engine.tool_parsers.base.ToolParser` subclass and registers it in a
function the registry calls with itself::

    from engine.tool_parsers import ToolParser, CallBlock

    class MyParser(ToolParser):
        tool_call_start_markers = ("<call>",)

        def scan_call_block(self, text, start, final, names, memo):
            ...

    def register_tool_parsers(registry):
        registry.register("my_parser", MyParser)
"""

from __future__ import annotations

from typing import Any

from engine.named_registry import NamedRegistry
from engine.tool_parsers.base import ToolParser
from engine.tool_parsers.hermes import HermesToolParser
from engine.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.tool_parsers.mistral import MistralToolParser
from engine.tool_parsers.openai import OpenAiToolParser
from engine.tool_parsers.pythonic import PythonicToolParser

#: the function a ``--tool-parser-plugin`` file defines; it is called with the registry
TOOL_PARSER_PLUGIN_HOOK = "register_tool_parsers"


class ToolParserRegistry(NamedRegistry[type[ToolParser]]):
    """Tool-parser classes by name; :func:`default_tool_parser_registry` makes one with the built-ins."""

    def __init__(self) -> None:
        super().__init__("tool parser", TOOL_PARSER_PLUGIN_HOOK)

    def register(self, name: str, entry: type[ToolParser], *, replace: bool = False) -> type[ToolParser]:
        """Add a parser class under ``name``.

        Args:
            name: what ``--tool-parser`` selects it by.
            entry: a :class:`ToolParser` subclass.
            replace: allow taking over a registered name.

        Returns:
            ``entry``.

        Raises:
            TypeError: ``entry`` is not a ToolParser subclass.
            ValueError: the name is empty, has whitespace, or is taken and ``replace`` is False.
        """
        if not (isinstance(entry, type) and issubclass(entry, ToolParser)):
            raise TypeError(f"tool parser {name!r} must be a ToolParser subclass, got {entry!r}")
        return super().register(name, entry, replace=replace)

    def create(self, name: str, tokenizer: Any = None, **kwargs: Any) -> ToolParser:
        """An instance of the parser registered under ``name``.

        Args:
            name: a registered name.
            tokenizer: the model's tokenizer, passed to the parser.
            **kwargs: more constructor arguments (``id_generator``).

        Returns:
            The parser.

        Raises:
            UnknownNameError: no parser has that name; the message lists the known ones.
        """
        return self.get(name)(tokenizer, **kwargs)


def default_tool_parser_registry() -> ToolParserRegistry:
    """A new registry holding the built-in parsers: hermes, llama3_json, mistral, openai, pythonic."""
    registry = ToolParserRegistry()
    registry.register("hermes", HermesToolParser)
    registry.register("llama3_json", Llama3JsonToolParser)
    registry.register("mistral", MistralToolParser)
    registry.register("openai", OpenAiToolParser)
    registry.register("pythonic", PythonicToolParser)
    return registry
