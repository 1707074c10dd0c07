"""Mistral calls, in both of the forms its models write::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the older models' (tokenizers up to v7: Mistral 7B v0.3, Mixtral, Nemo); the second is
v11 and later (Mistral Small 3.2, Magistral, Devstral), where a ``[CALL_ID]id`` may follow the name.
``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so the text must keep them. Mistral's chat
templates refuse call ids that are not 9 alphanumerics, so this family's ids are those.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

from engine.tool_parsers.base import CallBlock, ParsedCall, ToolParser
from engine.tool_parsers.json_calls import arguments_json, call_from_json, decode_json, skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"

_ALPHANUMERIC = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
# what may stand between [TOOL_CALLS] and [ARGS]: a function name, perhaps with its call id
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def mistral_call_id() -> str:
    """A fresh Mistral call id: 9 random alphanumerics."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls, or by ``name[ARGS]{...}``."""

    tool_call_start_markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def default_call_id(self) -> str:
        return mistral_call_id()

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        pos = skip_whitespace(text, start + len(TOOL_CALLS))
        if pos == len(text):
            return CallBlock(len(text), None) if final else None
        if text[pos] in "[{":
            return self._scan_json(text, pos, final, names)
        return self._scan_named(text, pos, final, names)

    def _scan_json(self, text: str, pos: int, final: bool, names: frozenset[str] | None) -> CallBlock | None:
        decoded = decode_json(text, pos)
        if decoded is None:
            return CallBlock(len(text), None) if final else None
        value, end = decoded
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item, names) for item in items]
        if not calls or any(call is None for call in calls):
            return CallBlock(end, None)
        return CallBlock(end, [call for call in calls if call is not None])

    def _scan_named(self, text: str, pos: int, final: bool, names: frozenset[str] | None) -> CallBlock | None:
        args = text.find(ARGS, pos)
        next_block = text.find(TOOL_CALLS, pos)
        if args < 0 or (0 <= next_block < args):
            if next_block >= 0:
                return CallBlock(next_block, None)
            return CallBlock(len(text), None) if final else None
        head = text[pos:args]
        name, _, call_id = head.partition(CALL_ID)
        if not _NAME.fullmatch(name) or (names is not None and name not in names):
            return self._skip_malformed(text, args, final)
        decoded = decode_json(text, args + len(ARGS))
        if decoded is None:
            # unfinished JSON may still complete (even past a "[TOOL_CALLS]" inside one of its strings)
            return self._skip_malformed(text, args, final) if final else None
        value, end = decoded
        arguments = arguments_json(value)
        if arguments is None:
            return CallBlock(end, None)
        # the model's own id is kept only in the form Mistral's templates accept back
        model_id = call_id if _MISTRAL_ID.fullmatch(call_id) else None
        return CallBlock(end, [ParsedCall(name=name, arguments=arguments, id=model_id)])

    @staticmethod
    def _skip_malformed(text: str, pos: int, final: bool) -> CallBlock | None:
        """A malformed named call runs to the next ``[TOOL_CALLS]``, or to the end of the output."""
        next_block = text.find(TOOL_CALLS, pos)
        if next_block >= 0:
            return CallBlock(next_block, None)
        return CallBlock(len(text), None) if final else None
