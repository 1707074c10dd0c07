"""Tool-call parsing: splitting a model's output into text and OpenAI ``tool_calls``, whole or streamed.

Pick a parser by name from :func:`default_tool_parser_registry` (``hermes``, ``llama3_json``,
``mistral``, ``pythonic``); ``extract_tool_calls`` reads a finished output, ``start_stream`` returns
the per-request state of a streamed one. See :mod:`engine.tool_parsers.base` for the rule on
malformed output.
"""

from __future__ import annotations

from engine.named_registry import PluginFileError, UnknownNameError
from engine.tool_parsers.base import (
    CallBlock,
    ParsedCall,
    ToolParser,
    ToolsArg,
    function_names,
    openai_call_id,
)
from engine.tool_parsers.hermes import HermesToolParser
from engine.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.tool_parsers.mistral import MistralToolParser, mistral_call_id
from engine.tool_parsers.pythonic import PythonicToolParser
from engine.tool_parsers.registry import (
    TOOL_PARSER_PLUGIN_HOOK,
    ToolParserRegistry,
    default_tool_parser_registry,
)
from engine.tool_parsers.stream import ToolCallStream
from engine.tool_parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
)

__all__ = [
    "TOOL_PARSER_PLUGIN_HOOK",
    "CallBlock",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedCall",
    "PluginFileError",
    "PythonicToolParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "ToolParserRegistry",
    "ToolsArg",
    "UnknownNameError",
    "default_tool_parser_registry",
    "function_names",
    "mistral_call_id",
    "openai_call_id",
]
