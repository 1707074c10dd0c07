"""Turn one step's logits into sampled tokens, their logprobs and ranks.

Logprobs, ranks and top logprobs are always taken from ``log_softmax`` of the *raw* model logits, before
logit bias, penalties, temperature or truncation: they report what the model thinks, which is what
OpenAI-style clients expect, and they stay comparable across requests with different sampling settings.

A structured-output row arrives with its disallowed tokens' logits at ``-inf`` (the runner masks them and
keeps the raw logits for the logprobs). Processing order for a row: logit bias, min_tokens suppression of
EOS and stop tokens, repetition penalty (prompt + output), presence and frequency penalties (output), then
either argmax (greedy) or temperature, top-k, top-p, min-p and a draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.host_copy import copy_to_device_async
from engine.interfaces.ops import argmax_with_logprob
from engine.interfaces.ops import greedy_pick as reference_greedy_pick
from engine.sampling.params import SamplingParams
from engine.sampling.truncation import draw, truncated_probs


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample.

    Attributes:
        params: the request's sampling settings.
        prompt_token_ids: the prompt, for the repetition penalty.
        output_token_ids: tokens this sequence generated so far (penalties, min_tokens).
        generator: the sequence's own generator when the request has a seed, else None.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass(slots=True)
class SampleResult:
    """What the sampler picked, one entry per row.

    Attributes:
        token_ids: the sampled token of each row.
        logprobs: raw-logit logprob of each sampled token.
        ranks: rank of each sampled token under the raw logits (1 = most likely).
        top_logprobs: per row, the ``params.logprobs`` most likely ``(token_id, logprob)`` pairs, best
            first, or None when the row did not ask for logprobs.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: the per-sequence source of randomness for seeded requests.

    Any integer is taken modulo 2**64, as torch already takes negative seeds, so that ``seed + index``
    (completion ``index`` of a request) stays valid at the top of the range.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed % 2**64)
    return generator


def greedy_result(ids_and_logprobs: torch.Tensor, top_logprobs: list | None = None) -> SampleResult:
    """A :class:`SampleResult` from ``[2, rows]`` float64 (token ids, then their logprobs), copied to the
    host in one transfer (float64 holds every token id and float32 logprob exactly); ranks are 1."""
    ids, values = ids_and_logprobs.tolist()
    return SampleResult([int(t) for t in ids], values, [1] * len(ids), top_logprobs or [None] * len(ids))


def needs_processing(row: SamplingRow) -> bool:
    """Whether the row changes the logits before the pick (anything beyond a plain argmax or draw)."""
    p = row.params
    return bool(
        p.logit_bias
        or p.allowed_token_ids
        or p.bad_words
        or (p.min_tokens and len(row.output_token_ids) < p.min_tokens)
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        eos_token_ids: tokens min_tokens keeps from being sampled too early.
        vocab_size: the real vocabulary; logits columns at or past it (padding) are never sampled.
        greedy_pick: the op table's ``greedy_pick`` (a platform may fuse it into one kernel); the core's
            reference when None.
    """

    def __init__(
        self,
        eos_token_ids: list[int],
        vocab_size: int,
        greedy_pick: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._greedy_pick = greedy_pick or reference_greedy_pick

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None = None,
        raw_logits: torch.Tensor | None = None,
    ) -> SampleResult:
        """Sample one token per row.

        Args:
            logits: ``[len(rows), width]`` with ``width >= vocab_size``; extra columns are padding.
            rows: per row settings and history, in the order of the logits rows.
            generator: the engine's generator for rows without a seed (None: torch's default).
            raw_logits: the model's logits when ``logits`` were masked (structured output): the pick
                uses ``logits``, the reported logprobs and ranks these; None: ``logits`` are raw.

        Returns:
            The sampled tokens with their raw logprobs, ranks and requested top logprobs.

        Raises:
            ValueError: the logits do not match the rows or are narrower than the vocabulary, or a
                row names a token id outside the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}"
            )
        if not rows:
            return SampleResult([], [], [], [])
        logits = logits[:, : self.vocab_size].float()
        raw = logits if raw_logits is None else raw_logits[:, : self.vocab_size].float()

        if self.runs_on_any_device(rows):
            if raw_logits is None:
                return self._greedy_fast_path(logits, rows)
            token_ids = logits.argmax(dim=-1)
        else:
            processed = self.process(logits, rows) if any(needs_processing(r) for r in rows) else logits
            token_ids = self._pick(processed, rows, generator)
        raw_logprobs = torch.log_softmax(raw, dim=-1)
        sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1))
        if any(r.params.logprobs is not None for r in rows):
            ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
        else:  # ranks are reported with logprobs only: spare the pass over the vocabulary
            ranks = torch.ones(len(rows), dtype=torch.int64)
        return SampleResult(
            token_ids=token_ids.tolist(),
            logprobs=sampled_logprobs.squeeze(1).tolist(),
            ranks=ranks.tolist(),
            top_logprobs=self._top_logprobs(raw_logprobs, rows),
        )

    @staticmethod
    def runs_on_any_device(rows: list[SamplingRow]) -> bool:
        """Whether these rows take the greedy fast path, which uses only device-neutral tensor ops.

        Then the logits can stay where the model computed them and only the chosen ids and logprobs
        travel to the host, instead of ``[rows, vocab]`` float32 every step.
        """
        return all(r.params.greedy for r in rows) and not any(needs_processing(r) for r in rows)

    @staticmethod
    def samples_on_device(rows: list[SamplingRow]) -> bool:
        """Whether these rows can be sampled where the logits are: greedy or drawn with the engine's
        generator (temperature, top-k, top-p and min-p are device-neutral tensor ops) and unprocessed.

        Seeded rows (their own host generator, shaped alone so that a seed gives the same tokens in any
        batch) and processed rows (penalties and biases read the host's token history) sample on the host.
        """
        return all(r.params.greedy or r.generator is None for r in rows) and not any(needs_processing(r) for r in rows)

    @staticmethod
    def draws_in_flight(rows: list[SamplingRow]) -> bool:
        """Whether these rows can be sampled on the device with nothing read back before their tokens are
        needed: :meth:`samples_on_device` rows, and no top-p row without top-k (its nucleus may need a
        second, full-vocabulary pass, chosen after reading the first)."""
        return Sampler.samples_on_device(rows) and not any(
            not r.params.greedy and r.params.top_p < 1.0 and r.params.top_k <= 0 for r in rows
        )

    def draw_on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and their raw logprobs for :meth:`draws_in_flight` rows, left on the logits' device:
        argmax for greedy rows, a draw from the tempered, truncated distribution for the others.

        Args:
            logits: ``[rows, width]`` with ``width >= vocab_size``.
            rows: their settings, unseeded and unprocessed.
            generator: the engine's generator.

        Returns:
            int64 token ids ``[rows]`` and float32 logprobs ``[rows]``.
        """
        logits = logits[:, : self.vocab_size].float()
        token_ids = self._pick(logits, rows, generator)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids.view(-1, 1)).view(-1)
        return token_ids, logprobs

    def greedy_on_device(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Argmax token ids and their raw logprobs, left on the logits' device (nothing waits for it).

        Args:
            logits: ``[rows, width]`` with ``width >= vocab_size``.

        Returns:
            int64 token ids ``[rows]`` and float32 logprobs ``[rows]``.
        """
        return self._greedy_pick(logits, self.vocab_size)

    def _greedy_fast_path(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        # The hot path: vectorised passes over the logits and no per-row work.
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids, logprobs = argmax_with_logprob(raw_logprobs)
        both = torch.stack((token_ids.to(torch.float64), logprobs.to(torch.float64)))
        return greedy_result(both, self._top_logprobs(raw_logprobs, rows))

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logit bias, min_tokens and penalties, applied to the rows that ask for them."""
        processed = logits.clone()
        device = logits.device
        vocab = self.vocab_size

        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            for tok, bias in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_cols.append(tok)
                bias_vals.append(bias)
            if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
                banned = set(self.eos_token_ids) | set(p.stop_token_ids or ())
                ban_rows.extend([i] * len(banned))
                ban_cols.extend(banned)
            if p.bad_words:
                banned = _bad_word_endings(p.bad_words_token_ids, row.output_token_ids)
                ban_rows.extend([i] * len(banned))
                ban_cols.extend(banned)
        self._check_ids(bias_cols, "logit_bias")
        self._check_ids(ban_cols, "stop_token_ids")
        if bias_rows:
            index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
            processed.index_put_(index, torch.tensor(bias_vals, device=device), accumulate=True)
        if ban_rows:
            index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device))
            processed.index_put_(index, torch.tensor(float("-inf"), device=device))

        for i, row in enumerate(rows):
            if row.params.allowed_token_ids:
                keep = torch.zeros(processed.shape[1], dtype=torch.bool, device=device)
                keep[torch.tensor(row.params.allowed_token_ids, device=device)] = True
                processed[i] = torch.where(keep, processed[i], torch.tensor(float("-inf"), device=device))

        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            seen = _token_counts(
                [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab, device
            ).gt(0)
            penalties = [rows[i].params.repetition_penalty for i in rep]
            penalty = torch.tensor(penalties, device=device).unsqueeze(1)
            sub = processed[rep]
            penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
            processed[rep] = torch.where(seen, penalised, sub)

        pen = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
        if pen:
            counts = _token_counts([rows[i].output_token_ids for i in pen], vocab, device)
            freq = torch.tensor([rows[i].params.frequency_penalty for i in pen], device=device).unsqueeze(1)
            pres = torch.tensor([rows[i].params.presence_penalty for i in pen], device=device).unsqueeze(1)
            processed[pen] = processed[pen] - freq * counts - pres * counts.gt(0).float()
        return processed

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def _pick(
        self, processed: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
    ) -> torch.Tensor:
        """Argmax for greedy rows, a draw from the truncated, tempered distribution for the others."""
        token_ids = processed.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return token_ids
        # Seeded rows are shaped and drawn alone, with their own generator, so their tokens cannot
        # depend on the rest of the batch; unseeded rows share one batched pass and the engine's generator.
        shared = [i for i in random_rows if rows[i].generator is None]
        if len(shared) == len(rows):
            token_ids = draw(truncated_probs(processed, [r.params for r in rows]), generator)
        elif shared:
            # the rows' index crosses from pinned memory: a list index would be a blocking copy
            index = copy_to_device_async(shared, processed.device)
            probs = truncated_probs(processed.index_select(0, index), [rows[i].params for i in shared])
            token_ids.index_copy_(0, index, draw(probs, generator))
        for i in random_rows:
            row_generator = rows[i].generator
            if row_generator is not None:
                probs = truncated_probs(processed[i : i + 1], [rows[i].params])
                token_ids[i] = draw(probs, row_generator)[0]
        return token_ids

    @staticmethod
    def _top_logprobs(
        raw_logprobs: torch.Tensor, rows: list[SamplingRow]
    ) -> list[list[tuple[int, float]] | None]:
        wanted = [r.params.logprobs for r in rows]
        k_max = max((k for k in wanted if k), default=0)
        if not k_max:
            return [None if k is None else [] for k in wanted]
        values, indices = raw_logprobs.topk(min(k_max, raw_logprobs.shape[1]), dim=-1)
        values_list, indices_list = values.tolist(), indices.tolist()
        return [
            None if k is None else list(zip(indices_list[i][:k], values_list[i][:k], strict=True))
            for i, k in enumerate(wanted)
        ]


def _bad_word_endings(sequences: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete a bad word now: a one-token word always, a longer one's last token
    when its other tokens end the output so far."""
    banned = set()
    for seq in sequences:
        head = seq[:-1]
        if not head or (len(output) >= len(head) and output[len(output) - len(head) :] == head):
            banned.add(seq[-1])
    return banned


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` float counts of each token id per list."""
    width = max((len(t) for t in token_lists), default=0)
    # Pad with an extra column that is dropped afterwards, so ragged lists scatter in one call.
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    # Ids the model cannot produce (a tokenizer's extra added tokens) carry no logit to penalise.
    padded = padded.masked_fill((padded < 0) | (padded > vocab_size), vocab_size).to(device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]
