"""The structured-output backend contract: constraints compiled to grammars, and one matcher per sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from engine.structured_output.params import GrammarSpec


class GrammarMatcher(ABC):
    """One sequence's position in a compiled grammar: which tokens may come next, and when it is done."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token.

        Args:
            token_id: the token the sequence generated.

        Returns:
            Whether the grammar accepted it (on False the state is unchanged).
        """

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by several tokens, all or none.

        Args:
            token_ids: the tokens, in order.

        Returns:
            Whether every token was accepted; on False the matcher is back where it started.
        """
        for done, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                if done:
                    self.rollback(done)
                return False
        return True

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``.

        Args:
            bitmask: host int32 ``[rows, words]``; bit ``j`` of word ``w`` allows token ``32 * w + j``.
            row: the row to fill (the others are left alone).
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token was accepted: nothing may follow."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: for more tokens than were accepted.
        """

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start, as if no token had been accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one model's vocabulary and makes matchers on the compiled grammars.

    ``parse`` and ``compile`` may run on worker threads at the same time; ``make_matcher`` and the
    matchers run on the engine's thread.
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The tokens a bitmask row covers: at most the model's vocabulary (its logits without padding);
        columns past a row's words are never allowed (see the ``apply_token_bitmask`` op)."""

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row."""
        return -(-self.vocab_size // 32)

    @abstractmethod
    def parse(self, spec: GrammarSpec) -> object:
        """Check a constraint and turn it into the backend's grammar (fast: no token masks yet).

        Raises:
            ValueError: the constraint is invalid (the message names the problem).
        """

    @abstractmethod
    def compile(self, grammar: object) -> object:
        """Compile a parsed grammar against the vocabulary (slow: token masks; run on a worker thread).

        Raises:
            ValueError: the grammar cannot be compiled.
        """

    @abstractmethod
    def make_matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` from ``matchers[i]``, for every ``i``.

        A step's constrained rows are filled together: a backend may spread them over threads (the
        default fills them one after another).

        Args:
            matchers: this backend's matchers.
            bitmask: the host bitmask of the step (see :meth:`allocate_bitmask`).
            rows: the row of each matcher.
        """
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_next_token_bitmask(bitmask, row)

    def start_step(
        self, matchers: list[GrammarMatcher], token_ids: list[int], bitmask: torch.Tensor
    ) -> tuple[list[tuple[int, bool]], Callable[[], None]]:
        """:meth:`advance_step`, then each matcher's next mask started into row ``i`` of ``bitmask``.

        A backend with threads of its own (:attr:`fills_in_background`) returns once the matchers have
        advanced, the fill still running, so that the caller's thread goes on meanwhile; the default
        fills before returning. Until the returned wait has returned, the matchers must not advance and
        the bitmask must not be read.

        Returns:
            What :meth:`advance_step` returns (the rows of the matchers it terminated are left unfilled:
            a terminated matcher has no next token), and the wait for the fill's end.
        """
        ended = self.advance_step(matchers, token_ids)
        rows = list(range(len(matchers)))
        if any(terminated for _, terminated in ended):
            done = {i for i, terminated in ended if terminated}
            rows = [i for i in rows if i not in done]
        self.fill_bitmasks([matchers[i] for i in rows], bitmask, rows)
        return ended, _filled

    @property
    def fills_in_background(self) -> bool:
        """Whether :meth:`start_step` returns before the masks are filled (then the manager starts the next
        step's masks as a step's tokens are accepted)."""
        return False

    def advance_step(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[tuple[int, bool]]:
        """:meth:`advance`, reporting only the matchers it ends (on most steps none).

        Returns:
            ``(i, accepted)`` for each ``i`` whose matcher refused its token (``accepted`` False) or
            was terminated by it (True), in order.
        """
        outcomes = self.advance(matchers, token_ids)
        return [(i, accepted) for i, (accepted, done) in enumerate(outcomes) if done or not accepted]

    def advance(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[tuple[bool, bool]]:
        """Advance ``matchers[i]`` by ``token_ids[i]``, for every ``i`` (a step's constrained rows).

        A backend may do it in one call into its library (the default advances them one by one).

        Returns:
            For each matcher: whether it accepted its token, and whether it is then terminated.
        """
        out = []
        for matcher, token_id in zip(matchers, token_ids, strict=True):
            accepted = matcher.accept_token(token_id)
            out.append((accepted, accepted and matcher.is_terminated()))
        return out

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A host int32 ``[rows, bitmask_words]`` bitmask, every token allowed."""
        return torch.full((rows, self.bitmask_words), -1, dtype=torch.int32)


def _filled() -> None:
    """The wait of a fill that ended before :meth:`StructuredOutputBackend.start_step` returned."""
