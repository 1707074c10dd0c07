"""Per-sequence output state: incremental detokenisation, stop conditions, and what a sequence produced.

``engine.output_processor`` drives these for every sampled token; the scheduler never sees them.
"""

from __future__ import annotations

from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.state import SequenceOutputState
from engine.output.stop import StopChecker, StopDecision

__all__ = ["IncrementalDetokenizer", "SequenceOutputState", "StopChecker", "StopDecision"]
