"""The engine's side of speculative decoding: proposals for the sequences that just got a token, and the
acceptance counters."""

from __future__ import annotations

from collections.abc import Iterable

from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import propose_ngram
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
            tokens = seq.prompt_token_ids + seq.output_token_ids
            seq.spec_tokens = propose_ngram(tokens, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

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
