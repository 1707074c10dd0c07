"""Beam search on the paged KV cache: beams fork their parent's blocks and copy on write.

Each step every live beam offers its ``2 * beam_width`` most likely next tokens; the best
``2 * beam_width`` candidates over all beams of a prompt are taken in score order, ending ones (EOS)
becoming finished hypotheses and the others becoming the next beams (at most ``beam_width``). A new beam
shares every block of its parent by reference; the parent's partly filled last block is copied only when
the beam writes into it. Hypotheses are ranked by ``sum of logprobs / generated_length ** length_penalty``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling.params import SamplingParams
from engine.sequence import Sequence, SequenceStatus


class BeamSearchParams(BaseModel):
    """Beam search settings.

    Attributes:
        beam_width: beams kept per prompt (also the number of sequences returned).
        max_tokens: most tokens to generate.
        length_penalty: exponent of the length normalisation; above 1 favours longer outputs.
        early_stopping: stop a prompt as soon as ``beam_width`` hypotheses have finished.
        ignore_eos: never finish a hypothesis on EOS.
    """

    model_config = ConfigDict(extra="forbid")

    beam_width: int = Field(4, ge=1, le=10)
    max_tokens: int = Field(16, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool = False
    ignore_eos: bool = False


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamHypothesis]


@dataclass(slots=True)
class _Beam:
    seq: Sequence
    cumulative_logprob: float = 0.0
    top: list[tuple[int, float]] | None = None  # next-token candidates once it has sampled


@dataclass(slots=True)
class _Group:
    prompt_token_ids: list[int]
    beams: list[_Beam]
    finished: list[BeamHypothesis] = field(default_factory=list)
    done: bool = False


def beam_search(engine: object, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for token-id prompts on an idle :class:`~engine.llm_engine.LLMEngine`.

    Raises:
        InvalidRequestError: a prompt does not fit the context with ``max_tokens``.
        RuntimeError: if the engine has other requests in flight.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search needs an idle engine")
    width = params.beam_width
    step_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=2 * width, ignore_eos=True)
    for p in prompts:
        engine.validate_request(p, step_params)
    scheduler, bm, runner = engine.scheduler, engine.block_manager, engine.runner
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    ids = itertools.count(10**12)  # clear of the engine's own sequence ids

    def new_seq(prompt: list[int], output: list[int]) -> Sequence:
        return Sequence(seq_id=next(ids), request_id="beam", index=0, prompt_token_ids=prompt,
                        params=step_params, arrival=next(ids), output_token_ids=output)

    groups = []
    for p in prompts:
        root = new_seq(p, [])
        scheduler.add(root)
        groups.append(_Group(p, [_Beam(root)]))
    owner = {b.seq.seq_id: (g, b) for g in groups for b in g.beams}
    try:
        while any(not g.done for g in groups):
            plan = scheduler.schedule()
            if plan.is_empty:
                raise RuntimeError("beam search cannot make progress: the KV cache is too small for its beams")
            targets, result = runner.execute(plan, None)
            scheduler.advance(plan)
            for i, seq in enumerate(targets):
                group, beam = owner[seq.seq_id]
                beam.top = result.top_logprobs[i]
                scheduler.running.remove(seq)  # parked (blocks kept) until its whole group has sampled
            for group in groups:
                if not group.done and all(b.top is not None for b in group.beams):
                    _expand(group, params, eos, new_seq, scheduler, bm, owner)
    finally:
        for g in groups:
            for b in g.beams:
                scheduler.remove(b.seq)
                owner.pop(b.seq.seq_id, None)
    tok = engine.tokenizer
    outputs = []
    for g in groups:
        best = sorted(g.finished, key=lambda h: h.score, reverse=True)[:width]
        for h in best:
            h.text = tok.decode(h.token_ids)
        outputs.append(BeamSearchOutput(g.prompt_token_ids, best))
    return outputs


def _expand(group: _Group, params: BeamSearchParams, eos: set[int], new_seq, scheduler, bm, owner) -> None:
    width = params.beam_width
    candidates = [
        (beam.cumulative_logprob + lp, beam, tok) for beam in group.beams for tok, lp in (beam.top or [])
    ]
    candidates.sort(key=lambda c: c[0], reverse=True)
    next_beams: list[_Beam] = []
    for rank, (score, parent, tok) in enumerate(candidates[: 2 * width]):
        tokens = parent.seq.output_token_ids + [tok]
        if tok in eos:
            if rank < width:
                group.finished.append(BeamHypothesis(tokens, score, score / len(tokens) ** params.length_penalty))
            continue
        child = new_seq(group.prompt_token_ids, tokens)
        bm.fork(parent.seq.seq_id, child.seq_id)
        child.num_computed_tokens = parent.seq.num_computed_tokens
        scheduler.add_running(child)
        beam = _Beam(child, score)
        owner[child.seq_id] = (group, beam)
        next_beams.append(beam)
        if len(next_beams) == width:
            break
    for beam in group.beams:
        beam.seq.status = SequenceStatus.FINISHED
        scheduler.remove(beam.seq)
        owner.pop(beam.seq.seq_id, None)
    group.beams = next_beams
    length = len(next_beams[0].seq.output_token_ids) if next_beams else 0
    finished_enough = len(group.finished) >= width
    if finished_enough and params.early_stopping:
        stop = True
    elif finished_enough and next_beams:
        # No running beam can still beat the worst kept hypothesis (scores only fall as beams grow when
        # length_penalty > 0, so this compares against the best it could reach now).
        worst = sorted(h.score for h in group.finished)[-width]
        stop = next_beams[0].cumulative_logprob / length**params.length_penalty < worst
    else:
        stop = False
    if length >= params.max_tokens or not next_beams or stop:
        if not stop:
            for beam in next_beams:
                toks = beam.seq.output_token_ids
                group.finished.append(
                    BeamHypothesis(list(toks), beam.cumulative_logprob, beam.cumulative_logprob / len(toks) ** params.length_penalty)
                )
        for beam in next_beams:
            scheduler.remove(beam.seq)
            owner.pop(beam.seq.seq_id, None)
        group.beams = []
        group.done = True
