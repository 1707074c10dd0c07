"""What one sequence has produced so far, as its caller will see it, apart from the scheduler's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.stop import StopChecker

if TYPE_CHECKING:
    import torch

    from engine.outputs import Logprob


@dataclass(slots=True, eq=False)
class SequenceOutputState:
    """The sampling and output state of one sequence, owned by output processing.

    Attributes:
        detokenizer: turns the sequence's tokens into text.
        stop_checker: decides when the sequence is finished.
        generator: the sequence's own generator when its request has a seed, else None (the sampler
            then draws from the engine's shared generator).
        defer_text: text is decoded once when the sequence finishes, not per token (a final-only
            request without stop strings).
        text: the text so far (cut at a stop string once finished).
        cumulative_logprob: sum of the sampled tokens' logprobs.
        logprobs: per generated token ``{token_id: Logprob}``, when the request asked for logprobs.
        finish_reason: None while running; ``"stop"``, ``"length"`` or ``"abort"`` once done.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None = None
    defer_text: bool = False
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
