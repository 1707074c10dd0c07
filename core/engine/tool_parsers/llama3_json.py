"""JSON calls as Llama 3.1 and 3.2 write them with their JSON tool-calling template::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

A block starts at ``<|python_tag|>`` (kept in the text only when special tokens are not skipped) or at
a ``{`` that opens the output, and holds one or more objects separated by ``;``. The arguments are
under ``parameters``, or ``arguments`` as some fine-tunes write. A block is all calls or, if any
object in it is not a well-formed call, content.
"""

from __future__ import annotations

from typing import Any

from engine.tool_parsers.base import CallBlock, ParsedCall, ToolParser
from engine.tool_parsers.json_calls import call_from_json, decode_json, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """One or more ``{"name": ..., "parameters": {...}}`` objects joined by ``;``."""

    tool_call_start_markers = (PYTHON_TAG,)
    leading_call_chars = "{"

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls: list[ParsedCall] = []
        malformed = False
        while True:
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                if not final:
                    return None
                # a bare tag, or a trailing ";", with nothing after it
                malformed = malformed or not calls
                return CallBlock(len(text), None if malformed else calls)
            if text[pos] != "{":
                return CallBlock(len(text), None) if final else None
            decoded = decode_json(text, pos)
            if decoded is None:
                if not final:
                    return None
                return CallBlock(len(text), None)
            value, pos = decoded
            call = call_from_json(value, names, argument_keys=("parameters", "arguments"))
            if call is None:
                malformed = True
            else:
                calls.append(call)
            after = skip_whitespace(text, pos)
            if after == len(text) and not final:
                return None  # a ";" and another call may follow
            if after == len(text) or text[after] != ";":
                return CallBlock(pos, None if malformed else calls)
            pos = after + 1
