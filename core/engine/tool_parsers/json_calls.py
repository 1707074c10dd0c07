"""Reading calls written as JSON objects (``{"name": ..., "arguments": {...}}``), shared by the JSON
families, with the checks that make a call well formed."""

from __future__ import annotations

import json
from typing import Any

from engine.tool_parsers.base import ParsedCall

_DECODER = json.JSONDecoder()


def skip_whitespace(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after ``pos`` (``len(text)`` if none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """Decode the JSON value that starts at ``pos`` (leading whitespace allowed).

    Args:
        text: the output.
        pos: where the value (or whitespace before it) starts.

    Returns:
        ``(value, end)`` with ``end`` just past the value, or None when no complete value is there
        (truncated or invalid: a caller that may still get more text waits, one that may not gives up).
    """
    try:
        return _DECODER.raw_decode(text, skip_whitespace(text, pos))
    except (json.JSONDecodeError, RecursionError):
        return None


def arguments_json(value: Any) -> str | None:
    """The JSON text of a call's arguments, or None when they are not a JSON object.

    A string holding an object's JSON is accepted too, as some models quote their arguments.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        # NaN and infinities are not JSON; a client's json.loads of them would fail
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def call_from_json(
    value: Any, names: frozenset[str] | None, argument_keys: tuple[str, ...] = ("arguments",)
) -> ParsedCall | None:
    """The call a decoded JSON value describes, or None when it is not a well-formed call.

    Args:
        value: the decoded JSON.
        names: the function names allowed; None for any.
        argument_keys: the keys the arguments may be under, first match wins (Llama writes
            ``parameters``); a call with none of them has no arguments (``{}``).

    Returns:
        The call, or None: not an object, no string ``name``, a name not in ``names``, arguments
        that are not an object.
    """
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    raw_arguments: Any = {}
    for key in argument_keys:
        if key in value:
            raw_arguments = value[key]
            break
    arguments = arguments_json(raw_arguments)
    if arguments is None:
        return None
    return ParsedCall(name=name, arguments=arguments)
