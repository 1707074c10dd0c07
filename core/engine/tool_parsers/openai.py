"""gpt-oss's calls in OpenAI's harmony format: a message on the ``commentary`` channel addressed to a function::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or with the recipient in the header's role part (``<|start|>assistant to=functions.get_weather<|channel|>
commentary json<|message|>...``). The ``openai_gptoss`` reasoning parser passes a call on in the first form;
this parser also reads either form in raw harmony text. A block runs from the marker to ``<|call|>`` (or
``<|end|>``; the stop token itself is usually not in the output, so a finished output may end the block).
The markers are special tokens, so the server detokenizes with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import re
from typing import Any

from engine.tool_parsers.base import CallBlock, ParsedCall, ToolParser
from engine.tool_parsers.json_calls import arguments_json

CHANNEL_CALL = "<|channel|>commentary to="
ROLE_CALL = "<|start|>assistant to="
MESSAGE = "<|message|>"
BLOCK_ENDS = ("<|call|>", "<|end|>", "<|return|>")
#: the recipient: ``functions.`` and the function's name, up to whitespace or the next marker
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class OpenAiToolParser(ToolParser):
    """Harmony's function calls (gpt-oss), any number, with text around them."""

    tool_call_start_markers = (CHANNEL_CALL, ROLE_CALL)
    needs_special_tokens = True

    def scan_call_block(
        self, text: str, start: int, final: bool, names: frozenset[str] | None, memo: dict[str, Any]
    ) -> CallBlock | None:
        body_start = text.find(MESSAGE, start)
        # another block's start before this header's message marker: this one never got its body
        following = [i for i in (text.find(m, start + 1) for m in self.tool_call_start_markers) if i >= 0]
        if body_start < 0 or (following and min(following) < body_start):
            if following:
                return CallBlock(min(following), None)
            return CallBlock(len(text), None) if final else None
        body_start += len(MESSAGE)
        ends = [(i, m) for i, m in ((text.find(m, body_start), m) for m in BLOCK_ENDS) if i >= 0]
        if ends:
            body_end, marker = min(ends)
            end = body_end + len(marker)
        elif final:
            body_end = end = len(text)
        else:
            return None
        recipient = RECIPIENT.search(text, start, body_start)
        if recipient is None:
            return CallBlock(end, None)
        name = recipient.group(1)
        arguments = arguments_json(text[body_start:body_end])
        if arguments is None or (names is not None and name not in names):
            return CallBlock(end, None)
        return CallBlock(end, [ParsedCall(name=name, arguments=arguments)])
