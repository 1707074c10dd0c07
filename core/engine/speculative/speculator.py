"""The engine's side of speculative decoding: proposals for the sequences that just got a token, the
suffix method's tries, and the acceptance counters."""

from __future__ import annotations

from collections.abc import Iterable

from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import propose_ngram
from engine.speculative.suffix import SuffixCache, SuffixTrie, propose_suffix
from engine.speculative.verify import Verified


class Speculator:
    """Proposes tokens for running decodes and counts what verification keeps.

    Args:
        config: the method and its settings.
        max_model_len: the context limit (proposals never run past it).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
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

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Set each decoding sequence's ``spec_tokens`` (empty where nothing matches or nothing fits).

        Constrained sequences (structured output) and pooling ones get none: their tokens are checked
        against a grammar step by step, or there are no tokens.
        """
        cfg = self.config
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
            tokens = seq.prompt_token_ids + seq.output_token_ids
            seq.spec_tokens = propose_ngram(tokens, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def finished(self, *seqs: Sequence, aborted: bool = False) -> None:
        """Forget ended sequences' tries; the outputs of those that finished (not ``aborted``) join the
        global trie.

        Args:
            seqs: the ended sequences (a request's, siblings included).
            aborted: they were stopped by the caller: their outputs are not kept.
        """
        for seq in seqs:
            self.tries.pop(seq.seq_id, None)
            if self.cache is not None and not aborted:
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

    def stats(self) -> dict[str, float | int]:
        """Acceptance rate and mean accepted length (tokens kept per verified step, the bonus included)."""
        steps = self.num_verified_steps
        return {
            "spec_method": self.config.method,
            "spec_num_proposed_tokens": self.num_proposed,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_acceptance_rate": round(self.num_accepted / self.num_proposed, 4) if self.num_proposed else 0.0,
            "spec_mean_accepted_length": round((self.num_accepted + steps) / steps, 4) if steps else 0.0,
        }
