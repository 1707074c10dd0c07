"""The engine's side of speculative decoding: proposals for the sequences that just got a token, the
suffix method's tries, and the acceptance counters."""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import DraftModelProposer, DraftParts
from engine.speculative.eagle import EagleParts, EagleProposer
from engine.speculative.ngram import propose_ngram
from engine.speculative.suffix import SuffixCache, SuffixTrie, propose_suffix
from engine.speculative.switch import SpeculationSwitch
from engine.speculative.verify import Verified


class Speculator:
    """Proposes tokens for running decodes and counts what verification keeps.

    Args:
        config: the method and its settings.
        max_model_len: the context limit (proposals never run past it).
        draft: the draft model's runner and pool (method ``draft_model``), or the EAGLE head's (methods
            ``eagle``, ``eagle3``).
    """

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftParts | EagleParts | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verified_steps = 0
        #: suffix: each running sequence's trie over its prompt and output, by seq id (made when it first
        #: proposes, dropped by :meth:`finished`)
        self.tries: dict[int, SuffixTrie] = {}
        #: suffix: the global trie over recently finished outputs (None: another method, or turned off)
        self.cache: SuffixCache | None = None
        if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0:
            self.cache = SuffixCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
        #: draft_model: the draft and its mirrors of the proposing sequences
        self.draft = DraftModelProposer(draft) if isinstance(draft, DraftParts) else None
        #: eagle, eagle3: the head and its mirrors of the proposing sequences
        self.eagle = EagleProposer(draft) if isinstance(draft, EagleParts) else None
        if draft is not None:
            self.max_model_len = min(max_model_len, draft.max_model_len)
        #: turns proposals off while steps without them decode faster (None: ``auto_disable`` off)
        self.switch = SpeculationSwitch() if config.auto_disable else None
        #: the step being run as the switch will see it: (batch, proposals after it, decode only, start time)
        self._measuring: tuple[int, bool, bool, float] | None = None
        #: tokens the steps gave since the running step began (read back late under overlap)
        self._emitted = 0
        #: whether the sequences of the running step get proposals once its tokens are read
        self._propose_next = True
        #: the running step has at least ``disable_by_batch_size`` sequences
        self._capped = False

    def begin_step(self, plan: SchedulerOutput) -> bool:
        """Called as each step is scheduled: closes the measurement of the step before, decides whether
        this step's sequences get proposals once it is read, and says whether the step may be left in
        flight (overlapped with the next one's scheduling), which only a step carrying no proposals and
        followed by none may be.

        Args:
            plan: the step about to be launched.

        Returns:
            Whether the engine may overlap this step.
        """
        now = time.perf_counter()
        if self.switch is not None and self._measuring is not None:
            batch, proposed, decode_only, started = self._measuring
            if decode_only:
                self.switch.observe(batch, proposed, self._emitted, now - started)
        self._emitted = 0
        batch = len(plan.scheduled)
        capped = self.config.disable_by_batch_size is not None and batch >= self.config.disable_by_batch_size
        self._propose_next = not capped and (self.switch is None or self.switch.allows(batch))
        self._capped = capped
        decode_only = all(item.num_new_tokens == 1 + item.num_spec for item in plan.scheduled)
        carries = any(item.num_spec for item in plan.scheduled)
        self._measuring = (batch, self._propose_next or carries, decode_only, now) if batch else None
        return not self._propose_next and not carries

    def propose(self, seqs: list[Sequence], emitted: int, read_late: bool = False) -> None:
        """Set each decoding sequence's ``spec_tokens`` (empty where nothing matches or nothing fits, or
        where the switch turned proposals off).

        Constrained sequences (structured output) and pooling ones get none: their tokens are checked
        against a grammar step by step, or there are no tokens.

        Args:
            seqs: the sequences the step just read gave tokens to, unfinished.
            emitted: the tokens that step gave in all.
            read_late: the step was overlapped: the next one is already in flight, so nothing is proposed.
        """
        cfg = self.config
        self._emitted += emitted
        if read_late or not self._propose_next:
            for seq in seqs:
                seq.spec_tokens = []
            if read_late or self._capped:
                return
            # a seeded request draws its random numbers differently with proposals than without: it keeps
            # them, so that its output does not depend on the switch's (timing-driven) choices
            seqs = [seq for seq in seqs if seq.params.seed is not None and not seq.params.greedy]
        drafting: dict[int, tuple[Sequence, int]] = {}
        for seq in seqs:
            params = seq.params
            room = min(cfg.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - len(seq.output_token_ids) - 1)
            if room <= 0 or seq.is_finished or seq.pooling is not None or params.structured_outputs is not None:
                seq.spec_tokens = []
                continue
            if cfg.method == "suffix":
                seq.spec_tokens = self._propose_suffix(seq, room)
                continue
            if self.draft is not None or self.eagle is not None:
                drafting[seq.seq_id] = (seq, room)
                continue
            tokens = seq.prompt_token_ids + seq.output_token_ids
            seq.spec_tokens = propose_ngram(tokens, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if drafting:
            proposer = self.draft if self.draft is not None else self.eagle
            assert proposer is not None
            for seq_id, tokens in proposer.propose(drafting).items():
                drafting[seq_id][0].spec_tokens = tokens

    def finished(self, *seqs: Sequence, aborted: bool = False) -> None:
        """Forget ended sequences' tries; the outputs of those that finished (not ``aborted``) join the
        global trie.

        Args:
            seqs: the ended sequences (a request's, siblings included).
            aborted: they were stopped by the caller: their outputs are not kept.
        """
        for seq in seqs:
            self.tries.pop(seq.seq_id, None)
            if self.draft is not None:
                self.draft.finished(seq.seq_id)
            if self.eagle is not None:
                self.eagle.finished(seq.seq_id)
            # while the switch keeps proposals off, the global trie is not fed either: at large batches
            # its upkeep in Python would cost more than the steps it was turned off to spare
            if self.cache is not None and not aborted and self._propose_next:
                self.cache.add(seq.output_token_ids)

    def _propose_suffix(self, seq: Sequence, room: int) -> list[int]:
        cfg = self.config
        depth = cfg.suffix_decoding_max_tree_depth
        trie = self.tries.get(seq.seq_id)
        if trie is None:
            trie = self.tries[seq.seq_id] = SuffixTrie(depth)
        prompt, output = seq.prompt_token_ids, seq.output_token_ids
        # feed only what was appended since the last call: O(new tokens * depth)
        if trie.num_tokens < len(prompt):
            trie.extend(prompt[trie.num_tokens :])
        trie.extend(output[trie.num_tokens - len(prompt) :])
        want = depth - 1
        tail = output[-want:] if len(output) >= want else prompt[max(0, len(prompt) - want + len(output)) :] + output
        cache = self.cache.trie if self.cache is not None else None
        return propose_suffix(
            trie, cache, tail, room, cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob
        )

    def record(self, verified: Iterable[Verified]) -> None:
        """Count a step's verifications."""
        for v in verified:
            self.num_proposed += v.proposed
            self.num_accepted += v.accepted
            self.num_verified_steps += 1

    def stats(self) -> dict[str, float | int | str]:
        """Acceptance rate and mean accepted length (tokens kept per verified step, the bonus included)."""
        steps = self.num_verified_steps
        return {
            "spec_method": self.config.method,
            "spec_num_proposed_tokens": self.num_proposed,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_num_verified_steps": steps,
            "spec_acceptance_rate": round(self.num_accepted / self.num_proposed, 4) if self.num_proposed else 0.0,
            "spec_mean_accepted_length": round((self.num_accepted + steps) / steps, 4) if steps else 0.0,
            "spec_steps_switched_off": self.switch.steps_off if self.switch is not None else 0,
        }
