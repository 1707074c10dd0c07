"""Reasoning parsing: splitting a reasoning model's output into ``reasoning_content`` and ``content``,
whole or streamed, and telling the engine when the thinking is over.

Pick a parser by name from :func:`default_reasoning_parser_registry` (``deepseek_r1``, ``qwen3``).
"""

from __future__ import annotations

from engine.named_registry import PluginFileError, UnknownNameError
from engine.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.reasoning.qwen3 import Qwen3ReasoningParser
from engine.reasoning.registry import (
    REASONING_PARSER_PLUGIN_HOOK,
    ReasoningParserRegistry,
    default_reasoning_parser_registry,
)
from engine.reasoning.think_tags import ThinkTagReasoningParser, ThinkTagStream

__all__ = [
    "REASONING_PARSER_PLUGIN_HOOK",
    "DeepSeekR1ReasoningParser",
    "PluginFileError",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningParserRegistry",
    "ReasoningStream",
    "ThinkTagReasoningParser",
    "ThinkTagStream",
    "UnknownNameError",
    "default_reasoning_parser_registry",
]
