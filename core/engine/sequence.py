"""Request and sequence state: what the scheduler moves between queues and the runner feeds the model.

What a sequence's output looks like (text, logprobs, finish reason) is not here: output processing keeps
it apart (``engine.output.state.SequenceOutputState``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling.params import SamplingParams

#: stands for a token the device sampled but the host has not read yet (overlapped steps): it is the last
#: output token of a sequence between the step that samples it and the next step, which reads it on the device
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream being generated (a request with ``n`` completions owns ``n`` of them).

    Attributes:
        seq_id: engine-unique id (also the key of its block table).
        request_id: the owning request.
        index: which of the request's completions this is.
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far (the last may be ``PENDING_TOKEN`` while a step is in flight).
        num_computed_tokens: leading tokens whose KV is in the cache.
        arrival: monotonically increasing admission order (lower is older, scheduled first).
        priority: lower runs first (0 by default); ties go to the older sequence.
        cache_salt: the request's prefix-cache salt: cached blocks are shared only between sequences
            with equal salts (None: shared with every unsalted sequence).
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    enqueued_step: int = 0
    #: when it last joined the waiting queue (the scheduler's clock, seconds)
    enqueued_time: float = 0.0
    # Siblings of an n > 1 request that take this sequence's prompt blocks once its prefill is done.
    pending_forks: list[Sequence] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    #: prompt tokens whose KV the prefix cache gave it when it was first admitted
    num_cached_tokens: int = 0
    #: a pooling request's settings (``PoolingParams``): its prompt's hidden states are pooled and no
    #: token is sampled; None for generation
    pooling: Any = None
    #: the prompt runs in one step, never in chunks (an encoder's bidirectional attention needs all of it)
    whole_prompt: bool = False
    #: speculative decoding: tokens proposed after the last one, checked by the next step
    spec_tokens: list[int] = field(default_factory=list)
    #: the token of a step still in flight is its last: a length limit (``max_tokens``, the context) ends it
    #: whatever that token is, so the scheduler gives it no further row (async scheduling)
    last_token_in_flight: bool = False
    #: the LoRA adapter it runs under (``LoRARequest.lora_int_id``), 0 for the base model
    lora_id: int = 0
    #: what the adapter adds to the prefix-cache key (prompts under different adapters share no blocks)
    lora_key: tuple[str, int] | None = None

    @property
    def prefix_key(self) -> object:
        """The extra key of its prefix-cache blocks: the cache salt, and the adapter if any."""
        return self.cache_salt if self.lora_key is None else (self.cache_salt, *self.lora_key)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt followed by output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    """A caller's request: a prompt and ``params.n`` sequences generating from it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence] = field(default_factory=list)
    #: the caller reads only the finished output (offline ``LLM``): no per-step outputs are built, and
    #: text is decoded once at the end when no stop string needs it earlier
    final_only: bool = False

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)
