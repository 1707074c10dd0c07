"""A step issued to the device: its sampled tokens, read back at once, left in flight, or waiting for masks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.pooling.pooler import PooledStep
from engine.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SampleResult, SamplingRow, greedy_result
from engine.sequence import Sequence
from engine.speculative.verify import Verified


@dataclass(slots=True)
class DeferredSampling:
    """What a step needs to sample once its constrained rows' masks can be filled.

    Attributes:
        logits: the sampled rows' logits, on the device.
        rows: their sampling settings.
        generator: the engine's generator for unseeded random rows.
        in_flight: the rows sample greedily on the device, so the tokens stay in flight.
    """

    logits: torch.Tensor
    rows: list[SamplingRow]
    generator: torch.Generator | None
    in_flight: bool


@dataclass(slots=True)
class LaunchedStep:
    """A step issued to the device. A synchronous step carries its result; an overlapped one carries its
    sampled tokens on the device (the next step reads them there) and a host copy in flight.

    Attributes:
        targets: the sequence of each sampled row.
        result: the sampled tokens, once read (always set for a synchronous step).
        token_ids: the overlapped step's int64 token ids ``[rows]`` on the device, else None.
        row_of: seq_id -> row of ``token_ids``.
    """

    targets: list[Sequence]
    result: SampleResult | None = None
    token_ids: torch.Tensor | None = None
    row_of: dict[int, int] = field(default_factory=dict)
    _host: torch.Tensor | None = None
    _ready: Any = None
    #: a step whose sampling waits for its token bitmask (:meth:`ModelRunner.sample_deferred`)
    deferred: DeferredSampling | None = None
    #: the logprobs of prompt tokens this step scored (requests with ``prompt_logprobs``), on the host
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    #: pooling requests' chunks this step computed (their hidden states reduced), on their way to the host
    pooled: PooledStep | None = None
    #: decodes whose proposals this step verified: the tokens each keeps (speculative decoding)
    verified: list[tuple[Sequence, Verified]] = field(default_factory=list)

    @property
    def overlapped(self) -> bool:
        """Whether the tokens are (or, for a deferred step, may be) left in flight."""
        return self.token_ids is not None or (self.deferred is not None and self.deferred.in_flight)

    def resolve(self) -> SampleResult | None:
        """The sampled tokens (None if no row sampled); waits only for this step's copy to land."""
        if self.result is None and self._host is not None:
            if self._ready is not None:
                self._ready.synchronize()
            self.result = greedy_result(self._host)
            self._host = self._ready = None
        return self.result
