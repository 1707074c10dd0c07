"""Test-only parser plugins for the server tests, loaded with ``--tool-parser-plugin`` and
``--reasoning-parser-plugin`` (this file defines both hooks).

The embedded SmolLM2 answers "What is the capital of France?" greedily with "The capital of France is
Paris.", and never writes a real tool call; these parsers read that answer predictably instead:
``word_calls`` takes each "France" and "Paris" as a call to the first tool offered, and ``until_is``
takes everything before " is" as the thinking.
"""

from __future__ import annotations

import json
from typing import Any

from engine.reasoning import ThinkTagReasoningParser
from engine.tool_parsers import CallBlock, ParsedCall, ToolParser


class WordCallParser(ToolParser):
    """Each "France" or "Paris" is a call ``{"city": word}`` to the alphabetically first tool."""

    tool_call_start_markers = ("France", "Paris")

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        word = "France" if text.startswith("France", start) else "Paris"
        name = sorted(names)[0] if names else "lookup"
        return CallBlock(start + len(word), [ParsedCall(name, json.dumps({"city": word}))])


class UntilIsReasoningParser(ThinkTagReasoningParser):
    """The output starts inside the thinking, which " is" ends."""

    start_marker = "<never>"
    end_marker = " is"
    start_marker_required = False


def register_tool_parsers(registry: Any) -> None:
    registry.register("word_calls", WordCallParser)


def register_reasoning_parsers(registry: Any) -> None:
    registry.register("until_is", UntilIsReasoningParser)
