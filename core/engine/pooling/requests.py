"""The engine's pooling requests: their accumulated chunks, and their outputs once the prompt is done."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.outputs import PoolingOutput, PoolingRequestOutput
from engine.pooling.config import PoolerConfig
from engine.pooling.params import PoolingParams
from engine.pooling.pooler import PooledChunk, PoolingState, pooled_results
from engine.sequence import Sequence


class PoolingRequests:
    """Pooling requests in flight, by request id.

    Args:
        defaults: the model's pooling (its sentence-transformers config, else its architecture's).
        head: the model's classification head (pooled hidden state -> logits), None without one.
    """

    def __init__(self, defaults: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.defaults = defaults
        self.head = head
        self._states: dict[str, PoolingState] = {}

    def add(self, request_id: str, params: PoolingParams) -> None:
        """Start accumulating a request's chunks."""
        self._states[request_id] = PoolingState(params)

    def discard(self, request_id: str) -> None:
        """Forget a request (aborted)."""
        self._states.pop(request_id, None)

    def take(self, chunks: list[PooledChunk]) -> list[tuple[Sequence, PoolingRequestOutput]]:
        """Add a step's chunks; returns the requests whose prompt is now fully pooled, with their outputs
        (their states are dropped)."""
        finished: list[tuple[Sequence, PoolingState]] = []
        for chunk in chunks:
            seq = chunk.seq
            state = self._states.get(seq.request_id)
            if state is None:
                continue  # aborted meanwhile
            state.add(chunk)
            if chunk.first_position + chunk.count == len(seq.prompt_token_ids):
                del self._states[seq.request_id]
                finished.append((seq, state))
        prompts = [seq.prompt_token_ids for seq, _ in finished]
        results = pooled_results([state for _, state in finished], self.defaults, self.head, prompts)
        return [
            (seq, PoolingRequestOutput(seq.request_id, seq.prompt_token_ids, PoolingOutput(result)))
            for (seq, _), result in zip(finished, results, strict=True)
        ]
