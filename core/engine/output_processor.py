"""Output processing: sampled tokens to text, logprob entries, stop decisions and request outputs.

Each sequence of a request being served has a :class:`~engine.output.state.SequenceOutputState` here,
keyed by its seq_id, from the request's admission until it finished (or was aborted) and its last
output was built. The scheduler never sees this state; the sampler reads only the seeded generators,
through :meth:`OutputProcessor.generator_of`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.state import SequenceOutputState
from engine.output.stop import StopChecker, StopDecision
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling.sampler import SampleResult, make_generator

if TYPE_CHECKING:
    import torch

    from engine.prompt_logprobs import PromptLogprobs
    from engine.sequence import Request, Sequence


class OutputProcessor:
    """Turns each sampled token into its sequence's output, and builds the requests' outputs.

    Args:
        tokenizer: the engine's tokenizer: decodes logprob entries' tokens, and its window decoder
            feeds the incremental detokenizers.
        eos_token_ids: tokens that end a sequence (unless the request ignores EOS).
        max_model_len: the context limit, prompt plus output.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._window_decoder = tokenizer.window_decoder()
        self._states: dict[int, SequenceOutputState] = {}
        #: request id -> its prompt tokens' logprob entries so far (``prompt_logprobs``; None for the first)
        self._prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = {}

    def add_request(self, request: Request) -> None:
        """Create the output state of each of the request's sequences (its ``sequences`` are built)."""
        params = request.params
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = [None]
        for seq in request.sequences:
            self._states[seq.seq_id] = SequenceOutputState(
                detokenizer=IncrementalDetokenizer(
                    self._window_decoder, request.prompt_token_ids, params.skip_special_tokens
                ),
                stop_checker=StopChecker(params, self.eos_token_ids, self.max_model_len),
                # completion i of a seeded request samples like a separate request seeded seed + i
                generator=make_generator(params.seed + seq.index) if params.seed is not None else None,
                defer_text=request.final_only and not params.stop,
                logprobs=[] if params.logprobs is not None else None,
            )

    def release(self, request: Request) -> None:
        """Forget a request's output state (it finished and its last output was built, or it was aborted)."""
        for seq in request.sequences:
            self._states.pop(seq.seq_id, None)
        self._prompt_logprobs.pop(request.request_id, None)

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """Record logprobs of prompt tokens a step scored (a prompt computed again after a preemption
        scores tokens it already has: those are kept as they were)."""
        entries = self._prompt_logprobs.get(scored.seq.request_id)
        if entries is None:
            return  # aborted meanwhile
        prompt, decode = scored.seq.prompt_token_ids, self.tokenizer.decode
        for i, (logprob, rank, top) in enumerate(zip(scored.logprobs, scored.ranks, scored.top)):
            position = scored.first_token + i
            if position < len(entries):
                continue
            token = prompt[position]
            entry = {token: Logprob(logprob, rank, decode([token], skip_special_tokens=False))}
            for top_rank, (tid, lp) in enumerate(top, start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, top_rank, decode([tid], skip_special_tokens=False))
            entries.append(entry)

    def state(self, seq: Sequence) -> SequenceOutputState:
        """The output state of a sequence of a request being served.

        Raises:
            KeyError: for a sequence this processor does not serve (a beam, or a released request's).
        """
        return self._states[seq.seq_id]

    def generator_of(self, seq: Sequence) -> torch.Generator | None:
        """The sequence's own generator when its request has a seed, else None (also for beams)."""
        state = self._states.get(seq.seq_id)
        return state.generator if state is not None else None

    def process_token(self, seq: Sequence, result: SampleResult, i: int, grammar_ended: bool = False) -> bool:
        """Record the token of row ``i`` of ``result``, already appended to ``seq.output_token_ids``.

        Adds its logprob (and the logprob entry, when asked for), decodes its text (unless the text is
        deferred) and checks the stop conditions; when they end the sequence, fixes its final text and
        finish reason. ``grammar_ended``: the sequence's grammar took its stop token (structured
        output), which ends it with ``"stop"`` even where the stop conditions would not (``ignore_eos``).

        Returns:
            Whether the sequence is finished (the caller then marks it so and frees its blocks).
        """
        state = self._states[seq.seq_id]
        token = seq.output_token_ids[-1]
        state.cumulative_logprob += result.logprobs[i]
        if state.logprobs is not None:
            state.logprobs.append(self._logprob_entry(token, result, i))
        new_text = "" if state.defer_text else state.detokenizer.step(token)
        state.text += new_text
        decision = state.stop_checker.check(seq.output_token_ids, seq.num_tokens, state.text, len(new_text))
        if decision is None and grammar_ended:
            # the stop token's text is cut as an EOS's is
            keep = seq.params.include_stop_str_in_output or state.defer_text
            decision = StopDecision("stop", None, None if keep else len(state.text) - len(new_text))
        if decision is None:
            return False
        if state.defer_text:
            # decoded only now (no stop strings needed it earlier); an EOS or stop token ends the text
            # before its own text, as the per-token path cuts it
            ids = seq.output_token_ids
            cut = decision.finish_reason == "stop" and not seq.params.include_stop_str_in_output
            state.text = state.detokenizer.decode_all(ids[:-1] if cut else ids)
        elif decision.text_end is not None:
            state.text = state.text[: decision.text_end]
        else:
            state.text += state.detokenizer.flush()
        state.finish_reason = decision.finish_reason
        state.stop_reason = decision.stop_reason
        return True

    def _logprob_entry(self, token: int, result: SampleResult, i: int) -> dict[int, Logprob]:
        """The sampled token's logprob and rank, then the top alternatives not already in it."""
        decode = self.tokenizer.decode
        entry = {token: Logprob(result.logprobs[i], result.ranks[i], decode([token], skip_special_tokens=False))}
        for rank, (tid, lp) in enumerate(result.top_logprobs[i] or (), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, decode([tid], skip_special_tokens=False))
        return entry

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: running sequences show only the text no stop string may still take back."""
        completions = []
        for seq in request.sequences:
            state = self._states[seq.seq_id]
            text = state.text if seq.is_finished else state.text[: state.stop_checker.streamable_len(state.text)]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=state.cumulative_logprob,
                    logprobs=list(state.logprobs) if state.logprobs is not None else None,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        prompt_logprobs = self._prompt_logprobs.get(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_cached_tokens=request.sequences[0].num_cached_tokens,
        )
