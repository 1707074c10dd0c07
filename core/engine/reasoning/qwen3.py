"""Qwen 3 (hybrid thinking): the model writes ``<think>reasoning</think>answer`` itself when thinking
is on; with ``enable_thinking=False`` the template closes an empty thinking block in the prompt, the
output has no ``<think>``, and it is all answer. (Qwen 3 "Thinking-2507" models, whose template opens
``<think>`` in the prompt, need ``deepseek_r1`` instead.)"""

from __future__ import annotations

from engine.reasoning.think_tags import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """``<think>...</think>`` at the start of the output is reasoning; without it, all is content."""

    start_marker_required = True
