"""Pythonic calls, as Llama 3.2 and Llama 4 write them with their pythonic templates::

    [get_weather(city="Paris", units="metric"), get_time(tz="Europe/Paris")]
    <|python_start|>[search(query="café", filters={"year": 2024})]<|python_end|>

The list is read with ``ast`` and its values with ``ast.literal_eval``: nothing the model wrote is
ever evaluated. A well-formed block is a non-empty list whose every item is ``name(kw=literal, ...)``
with keyword arguments only and JSON-representable literals (``True``/``None`` become ``true``/``null``).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from engine.tool_parsers.base import CallBlock, ParsedCall, ToolParser
from engine.tool_parsers.json_calls import skip_whitespace

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class PythonicToolParser(ToolParser):
    """A Python list of calls with literal keyword arguments, at the start of the output or in
    ``<|python_start|>...<|python_end|>``."""

    tool_call_start_markers = (PYTHON_START,)
    leading_call_chars = "["

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        tagged = text.startswith(PYTHON_START, start)
        list_start = skip_whitespace(text, start + len(PYTHON_START)) if tagged else start
        found = _find_list(text, list_start, memo)
        if found is None:
            return CallBlock(len(text), None) if final else None
        tree, end = found
        if tagged:
            after = skip_whitespace(text, end)
            if text.startswith(PYTHON_END, after):
                end = after + len(PYTHON_END)
            elif not final and PYTHON_END.startswith(text[after:]):
                return None  # the end tag may be on its way
        calls = _calls_from_list(tree, names)
        return CallBlock(end, calls)


# Python's tokens as far as finding the list's end needs them: strings (whose brackets do not count),
# comments, brackets, and runs of anything else; the quote(s) that open no complete string are matched alone
_TOKEN = re.compile(
    r'''"""(?:[^"\\]|\\[\s\S]|"(?!""))*"""'''
    r"""|'''(?:[^'\\]|\\[\s\S]|'(?!''))*'''"""
    r"|'''|\"\"\""
    r'''|"(?:[^"\\\n]|\\[\s\S])*"'''
    r"""|'(?:[^'\\\n]|\\[\s\S])*'"""
    r"|#[^\n]*"
    r"|[\[\](){}]"
    r"""|[^'"#\[\](){}]+"""
    r"""|['"]"""
)
_OPENING = frozenset("([{")
_CLOSING = frozenset(")]}")
_QUOTES = frozenset("'\"")
_UNTERMINATED = frozenset(("'", '"', "'''", '"""'))


def _find_list(text: str, start: int, memo: dict[str, Any]) -> tuple[ast.List, int] | None:
    """The list expression that starts at ``start``, as its tree and end.

    Returns None while the brackets are not balanced yet (or a string is open), and also when the
    balanced text is not a list Python parses: such a block has no clear end, so it is decided only
    when the output ends, and runs to the end like an unclosed one.

    ``memo`` keeps the scan's progress between deltas (the position after the last token that more
    text cannot change, the bracket depth there, and an open string's start), so a long list is read
    once rather than once per delta.
    """
    if start >= len(text) or text[start] != "[":
        return None
    pos, depth = memo.get("pos", start), memo.get("depth", 0)
    open_string = memo.get("open_string")
    if open_string is not None:
        if text.find(text[open_string], memo["checked"]) < 0:
            memo["checked"] = len(text)
            return None  # no quote character yet that could close it
    for token in _TOKEN.finditer(text, pos):
        kind = token.group()
        if kind in _OPENING:
            depth += 1
        elif kind in _CLOSING:
            depth -= 1
            if depth == 0:
                try:
                    tree = ast.parse(text[start : token.end()], mode="eval").body
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    return None
                return (tree, token.end()) if isinstance(tree, ast.List) else None
        elif kind in _UNTERMINATED:
            # an unterminated string: the rest of the text is inside it. The scan resumes from the
            # last final token rather than this quote, as the two quotes before it may have been
            # read as an empty string when they open a triple-quoted one.
            memo.update(open_string=token.start(), checked=token.end())
            return None
        # a bracket, or a closed string that is not an empty one right before a quote ('' then '
        # opens a triple-quoted string) nor at the very end, is final: the scan may resume after it
        if kind[0] in _OPENING or kind[0] in _CLOSING or (kind[0] in _QUOTES and _string_is_final(text, token)):
            memo.update(pos=token.end(), depth=depth, open_string=None)
    return None


def _string_is_final(text: str, token: re.Match[str]) -> bool:
    end = token.end()
    if end >= len(text):
        return False
    return len(token.group()) != 2 or text[end] != token.group()[0]


def _calls_from_list(tree: ast.List, names: frozenset[str] | None) -> list[ParsedCall] | None:
    calls: list[ParsedCall] = []
    for item in tree.elts:
        call = _call_from_node(item, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _call_from_node(node: ast.expr, names: frozenset[str] | None) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    name = node.func.id
    if names is not None and name not in names:
        return None
    arguments: dict[str, object] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        # sets, bytes and complex numbers are literals but not JSON; tuples become lists
        return ParsedCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return None
