"""DeepSeek R1 (and its distills, QwQ, Qwen 3 thinking-2507 models): the chat template opens the
thinking in the prompt, so the output is ``reasoning</think>answer``; a model that repeats ``<think>``
is read the same, and an output with no ``</think>`` (cut off while thinking) is all reasoning."""

from __future__ import annotations

from engine.reasoning.think_tags import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """Everything before ``</think>`` is reasoning; ``<think>`` is optional."""

    start_marker_required = False
