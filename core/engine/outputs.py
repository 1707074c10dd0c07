"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """A token's log-probability under the model, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation.

    Attributes:
        index: which of the request's ``n`` completions.
        text: the text so far (stop strings cut off unless asked to keep them).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs.
        logprobs: per generated token, ``{token_id: Logprob}`` with the sampled token and the top-k,
            when the request asked for logprobs.
        finish_reason: None while running; ``"stop"``, ``"length"`` or ``"abort"`` when done.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, if given as text.
        prompt_token_ids: the tokenized prompt.
        outputs: one entry per completion.
        finished: whether every completion is done.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token, ``{token_id: Logprob}``
            with the prompt's own token and the top alternatives given the tokens before it; None for the
            first token (and the list is only as long as the prompt computed so far).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result.

    Attributes:
        data: float32 ``[dimensions]`` on the host; ``[tokens, dimensions]`` for the per-token pooling types
            (``ALL``, ``STEP``).
    """

    data: Any

    @property
    def embedding(self) -> list[Any]:
        """The vector as a list (what ``LLM.embed`` callers read); a list of rows for per-token pooling."""
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        """A classifier's label probabilities (``LLM.classify``)."""
        return self.embedding

    @property
    def score(self) -> float:
        """A cross-encoder's or reward model's single score (``LLM.score``, ``LLM.reward``)."""
        return float(self.data.reshape(-1)[0])


@dataclass(slots=True)
class PoolingRequestOutput:
    """A finished pooling request (``LLM.embed``, ``LLM.encode``, ``/v1/embeddings``).

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the tokenized prompt.
        outputs: the pooled vector.
        finished: always True: a pooling request reports once, when its prompt is done.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
