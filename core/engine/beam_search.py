"""Beam search on the paged KV cache: beams fork their parent's blocks and copy on write.

Each step every live beam offers its ``2 * beam_width`` most likely next tokens; the best
``2 * beam_width`` candidates over all beams of a prompt are taken in score order, ending ones (EOS)
becoming finished hypotheses and the others becoming the next beams (at most ``beam_width``). A new beam
shares every block of its parent by reference; the parent's partly filled last block is copied only when
the beam writes into it. Hypotheses are ranked by ``sum of logprobs / generated_length ** length_penalty``.
Beam requests run in the engine's ordinary steps, batched with every other request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.block_manager import BlockManager
from engine.hybrid_block_manager import HybridBlockManager
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.structured_output.params import StructuredOutputsParams


class BeamSearchParams(BaseModel):
    """Beam search settings.

    Attributes:
        beam_width: beams kept per prompt (also the number of sequences returned).
        max_tokens: most tokens to generate.
        length_penalty: exponent of the length normalisation; above 1 favours longer outputs.
        early_stopping: stop a prompt as soon as ``beam_width`` hypotheses have finished.
        ignore_eos: never finish a hypothesis on EOS.
        structured_outputs: refused: beams rank their candidates by raw logprobs, which a grammar's mask
            would have to reshape; the field exists so the refusal names the combination.
    """

    model_config = ConfigDict(extra="forbid")

    beam_width: int = Field(4, ge=1, le=10)
    max_tokens: int = Field(16, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool = False
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    @model_validator(mode="after")
    def _refuse_structured_outputs(self) -> BeamSearchParams:
        if self.structured_outputs is not None:
            raise ValueError(
                "beam search with structured_outputs is not supported; sample with SamplingParams instead"
            )
        return self

    def step_params(self) -> SamplingParams:
        """What each beam asks of the sampler: its top ``2 * beam_width`` next tokens."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass(slots=True)
class _Beam:
    seq: Sequence
    cumulative_logprob: float = 0.0
    top: list[tuple[int, float]] | None = None  # next-token candidates once it has sampled


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float


@dataclass(slots=True)
class BeamGroup:
    """The live beams and finished hypotheses of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    beams: list[_Beam]
    finished: list[_Hypothesis] = field(default_factory=list)
    done: bool = False
    #: the request's prefix-cache salt, which every beam carries
    cache_salt: str | None = None


class BeamSearcher:
    """Runs the beam requests of one engine.

    Args:
        scheduler: the engine's scheduler (beams are ordinary sequences in it).
        block_manager: for forking a parent's blocks into its children.
        eos_token_ids: tokens that finish a hypothesis.
        next_seq_id: the engine's sequence-id source.
        next_arrival: the engine's arrival counter.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager | HybridBlockManager,
        eos_token_ids: list[int],
        next_seq_id: Callable[[], int],
        next_arrival: Callable[[], int],
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.eos = set(eos_token_ids)
        self.next_seq_id = next_seq_id
        self.next_arrival = next_arrival
        self.groups: dict[str, BeamGroup] = {}
        self._beam_of: dict[int, tuple[BeamGroup, _Beam]] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Start a beam group from its root sequence (queued in the scheduler to prefill); returns the root."""
        root = self._new_seq(request_id, prompt_token_ids, [], params, cache_salt)
        group = BeamGroup(request_id, prompt, prompt_token_ids, params, [_Beam(root)], cache_salt=cache_salt)
        self.groups[request_id] = group
        self._beam_of[root.seq_id] = (group, group.beams[0])
        self.scheduler.add(root)
        return root

    def owns(self, seq: Sequence) -> bool:
        return seq.seq_id in self._beam_of

    def on_sampled(self, seq: Sequence, top: list[tuple[int, float]] | None) -> None:
        """Record a beam's candidates and park it (blocks kept) until its whole group has sampled."""
        _, beam = self._beam_of[seq.seq_id]
        beam.top = top or []
        self.scheduler.park(seq)

    def expand_ready(self) -> list[RequestOutput]:
        """Advance every group whose beams all sampled; returns the outputs of groups that finished."""
        outputs = []
        for group in list(self.groups.values()):
            if group.beams and all(b.top is not None for b in group.beams):
                self._expand(group)
                if group.done:
                    del self.groups[group.request_id]
                    outputs.append(self._output(group))
        return outputs

    def abort(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        self._release(group.beams)
        group.beams = []
        return True

    # --- internals ----------------------------------------------------------------------------------

    def _new_seq(
        self, request_id: str, prompt: list[int], output: list[int], params: BeamSearchParams, cache_salt: str | None
    ) -> Sequence:
        return Sequence(
            seq_id=self.next_seq_id(), request_id=request_id, index=0, prompt_token_ids=prompt,
            params=params.step_params(), arrival=self.next_arrival(), output_token_ids=output, cache_salt=cache_salt,
        )

    def _release(self, beams: list[_Beam]) -> None:
        for beam in beams:
            beam.seq.status = SequenceStatus.FINISHED
            self.scheduler.remove(beam.seq)
            self._beam_of.pop(beam.seq.seq_id, None)

    def _expand(self, group: BeamGroup) -> None:
        params = group.params
        width = params.beam_width
        eos = set() if params.ignore_eos else self.eos
        candidates = [(b.cumulative_logprob + lp, b, tok) for b in group.beams for tok, lp in (b.top or [])]
        candidates.sort(key=lambda c: c[0], reverse=True)
        next_beams: list[_Beam] = []
        for rank, (score, parent, tok) in enumerate(candidates[: 2 * width]):
            tokens = parent.seq.output_token_ids + [tok]
            if tok in eos:
                if rank < width:
                    group.finished.append(_Hypothesis(tokens, score, score / len(tokens) ** params.length_penalty))
                continue
            child = self._new_seq(group.request_id, group.prompt_token_ids, tokens, params, group.cache_salt)
            child.lora_id, child.lora_key = parent.seq.lora_id, parent.seq.lora_key
            self.block_manager.fork(parent.seq.seq_id, child.seq_id)
            child.num_computed_tokens = parent.seq.num_computed_tokens
            self.scheduler.add_running(child)
            beam = _Beam(child, score)
            self._beam_of[child.seq_id] = (group, beam)
            next_beams.append(beam)
            if len(next_beams) == width:
                break
        self._release(group.beams)
        group.beams = next_beams
        length = len(next_beams[0].seq.output_token_ids) if next_beams else 0
        enough = len(group.finished) >= width
        stop = enough and (
            params.early_stopping
            # Otherwise stop once the best live beam, scored now, cannot beat the worst kept hypothesis.
            or (bool(next_beams) and next_beams[0].cumulative_logprob / length**params.length_penalty
                < sorted(h.score for h in group.finished)[-width])
        )
        if length >= params.max_tokens or not next_beams or stop:
            if not stop:
                for b in next_beams:
                    toks = list(b.seq.output_token_ids)
                    group.finished.append(
                        _Hypothesis(toks, b.cumulative_logprob, b.cumulative_logprob / len(toks) ** params.length_penalty)
                    )
            self._release(next_beams)
            group.beams = []
            group.done = True

    def _output(self, group: BeamGroup) -> RequestOutput:
        best = sorted(group.finished, key=lambda h: h.score, reverse=True)[: group.params.beam_width]
        completions = [
            CompletionOutput(
                index=i, text="", token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
                finish_reason="stop" if h.token_ids and h.token_ids[-1] in self.eos and not group.params.ignore_eos else "length",
            )
            for i, h in enumerate(best)
        ]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished=True)
