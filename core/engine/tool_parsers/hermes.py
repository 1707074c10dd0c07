"""Hermes-style calls, as Qwen 2.5, Qwen 3 and the Hermes models write them::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
    </tool_call>

A block runs from ``<tool_call>`` to ``</tool_call>``; a missing closing tag (the model stopped, or
opened the next call at once) is tolerated when the JSON inside is complete.
"""

from __future__ import annotations

import json
from typing import Any

from engine.tool_parsers.base import CallBlock, ToolParser
from engine.tool_parsers.json_calls import call_from_json

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number, text around them."""

    tool_call_start_markers = (OPEN,)

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        body_start = start + len(OPEN)
        close = text.find(CLOSE, body_start)
        reopen = text.find(OPEN, body_start)
        if close >= 0 and (reopen < 0 or close < reopen):
            body_end, end = close, close + len(CLOSE)
        elif reopen >= 0:
            body_end = end = reopen
        elif final:
            body_end = end = len(text)
        else:
            return None
        try:
            value = json.loads(text[body_start:body_end])
        except (json.JSONDecodeError, RecursionError):
            return CallBlock(end, None)
        call = call_from_json(value, names)
        return CallBlock(end, None if call is None else [call])
