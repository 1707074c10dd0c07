"""The sampler against hand-computed references: processing formulas, truncation, seeds, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.input_processor import check_params_against_vocab
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler, SamplingRow, make_generator


def row(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingRow:
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, prompt or [], output or [], generator)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_greedy_fast_path_argmax_logprob_rank() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    result = Sampler([0], 11)(logits, [row(greedy()) for _ in range(5)])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert result.token_ids == logits.argmax(-1).tolist()
    for i, tok in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert result.ranks == [1] * 5
    assert result.top_logprobs == [None] * 5


def test_top_logprobs_and_rank_come_from_raw_logits() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 9)
    # A huge bias forces token 3; its logprob and rank must still describe the raw model distribution.
    params = greedy(logit_bias={3: 100.0}, logprobs=4)
    result = Sampler([0], 9)(logits, [row(params), row(greedy(logprobs=0))])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert result.token_ids[0] == 3
    assert result.logprobs[0] == pytest.approx(ref[0, 3].item(), abs=1e-5)
    assert result.ranks[0] == int((ref[0] > ref[0, 3]).sum()) + 1
    top_values, top_ids = ref[0].topk(4)
    assert [t for t, _ in result.top_logprobs[0]] == top_ids.tolist()
    assert [v for _, v in result.top_logprobs[0]] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert result.top_logprobs[1] == []


def test_padded_vocab_columns_never_sampled() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 16)
    logits[:, 10:] = 1e4  # padding columns past vocab_size 10 with the largest values
    rows = [
        row(greedy()),
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(seed=5)),
        row(greedy(logprobs=5)),
    ]
    for _ in range(20):
        result = Sampler([0], 10)(logits, rows)
        assert all(0 <= t < 10 for t in result.token_ids)
        assert all(t < 10 for t, _ in result.top_logprobs[3])
        assert result.token_ids[0] == logits[0, :10].argmax().item()


def test_logit_bias_added() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    result = Sampler([0], 4)(logits, [row(greedy(logit_bias={0: 2.5}))])
    assert result.token_ids == [0]  # 1.0 + 2.5 beats 3.0
    result = Sampler([0], 4)(logits, [row(greedy(logit_bias={0: 1.5}))])
    assert result.token_ids == [2]  # 2.5 does not


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    params = greedy(min_tokens=2, stop_token_ids=[1])
    sampler = Sampler([0], 4)
    assert sampler(logits, [row(params, output=[3])]).token_ids == [2]  # eos 0 and stop 1 banned
    assert sampler(logits, [row(params, output=[3, 3])]).token_ids == [0]  # min_tokens reached
    # ignore_eos does not lift the ban: min_tokens always holds
    ignore = greedy(min_tokens=1, ignore_eos=True)
    assert sampler(logits, [row(ignore)]).token_ids == [1]


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.3]])
    penalty = 2.0
    # token 0 (positive) is seen in the prompt, token 1 (negative) in the output
    expected = torch.tensor([[2.0 / penalty, -1.0 * penalty, 1.5, 0.3]])
    sampler = Sampler([3], 4)
    result = sampler(logits, [row(greedy(repetition_penalty=penalty), prompt=[0], output=[1])])
    assert result.token_ids == [2]  # 1.5 now beats 2.0/2
    processed = sampler.process(logits, [row(greedy(repetition_penalty=penalty), prompt=[0], output=[1])])
    torch.testing.assert_close(processed, expected)


def test_presence_and_frequency_penalty_formula() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 6)
    output = [1, 1, 1, 4]
    params = greedy(presence_penalty=0.5, frequency_penalty=0.25)
    processed = Sampler([0], 6).process(logits, [row(params, prompt=[2, 2], output=output)])
    expected = logits.clone()
    expected[0, 1] -= 0.5 + 3 * 0.25
    expected[0, 4] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(processed, expected)  # prompt tokens are not penalised


def test_penalties_batch_rows_independent() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 8)
    rows = [
        row(greedy(repetition_penalty=1.5), prompt=[1, 2], output=[3]),
        row(greedy()),
        row(greedy(frequency_penalty=1.0), output=[5, 5]),
    ]
    sampler = Sampler([0], 8)
    processed = sampler.process(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(processed[i : i + 1], sampler.process(logits[i : i + 1], [r]))
    torch.testing.assert_close(processed[1], logits[1])


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(5)
    logits = torch.randn(6, 50)
    sampler = Sampler([0], 50)
    topk1 = [row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(6)]
    assert sampler(logits, topk1).token_ids == logits.argmax(-1).tolist()
    # and when the batch takes the general path (another row has penalties)
    mixed = topk1[:5] + [row(SamplingParams(temperature=0.8, top_k=1, presence_penalty=1.0), output=[1])]
    assert sampler(logits, mixed).token_ids[:5] == logits[:5].argmax(-1).tolist()


def _sample_counts(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int = 0) -> torch.Tensor:
    sampler = Sampler([99], logits.shape[1])
    generator = make_generator(seed)
    batch = logits.expand(draws, -1).contiguous()
    tokens = sampler(batch, [row(params) for _ in range(draws)], generator).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[1])


def test_top_k_keeps_only_k_most_likely() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.0, 1.5, -0.3]])
    counts = _sample_counts(logits, SamplingParams(temperature=1.0, top_k=2), 2000)
    assert counts[[0, 2, 4]].sum() == 0 and counts[1] > 0 and counts[3] > 0


def test_top_p_edge_cases() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # smallest set with mass >= top_p: 0.4 -> {0}; 0.7 -> {0, 1}; 0.85 -> {0, 1, 2}
    for top_p, allowed in ((0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        counts = _sample_counts(logits, SamplingParams(top_p=top_p), 4000)
        assert {i for i, c in enumerate(counts.tolist()) if c} == allowed, top_p
    # a tiny top_p still keeps the most likely token
    assert set(_sample_counts(logits, SamplingParams(top_p=1e-6), 200).nonzero().flatten().tolist()) == {0}


def test_min_p_drops_relative_to_top_token() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    # threshold 0.2 * 0.5 = 0.1: tokens 0-2 stay, 3 (0.08) goes
    counts = _sample_counts(probs.log(), SamplingParams(min_p=0.2), 4000)
    assert counts[3] == 0 and (counts[:3] > 0).all()


@pytest.mark.parametrize("temperature, top_k", [(0.7, -1), (1.6, 3)])
def test_temperature_sampling_distribution_chi_square(temperature: float, top_k: int) -> None:
    torch.manual_seed(6)
    logits = torch.randn(1, 4) * 1.5
    scaled = logits.double()[0] / temperature
    if top_k > 0:
        scaled[scaled.argsort(descending=True)[top_k:]] = float("-inf")
    expected = torch.softmax(scaled, dim=-1)
    support = expected > 0
    draws = 20000
    counts = _sample_counts(
        logits, SamplingParams(temperature=temperature, top_k=top_k), draws, seed=11
    ).double()
    assert counts[~support].sum() == 0
    e = draws * expected[support]
    chi2 = (((counts[support] - e) ** 2) / e).sum().item()
    # at most 3 degrees of freedom: P(chi2 > 16.27) = 0.001
    assert chi2 < 16.27, (chi2, counts.tolist(), expected.tolist())


def test_seeded_draws_follow_the_distribution() -> None:
    torch.manual_seed(12)
    logits = torch.randn(1, 4)
    expected = torch.softmax(logits.double()[0], dim=-1)
    seeded = row(SamplingParams(temperature=1.0, seed=77))
    sampler = Sampler([9], 4)
    draws = 4000
    tokens = [sampler(logits, [seeded]).token_ids[0] for _ in range(draws)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    chi2 = (((counts - draws * expected) ** 2) / (draws * expected)).sum().item()
    assert chi2 < 16.27, (chi2, counts.tolist(), expected.tolist())


def test_seeded_rows_independent_of_batch_composition() -> None:
    torch.manual_seed(7)
    vocab = 49152
    target = torch.randn(1, vocab) * 3
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234, max_tokens=32)

    def run(batch_logits: torch.Tensor, rows_before: int, others: list[SamplingParams]) -> list[int]:
        seeded = SamplingRow(params, [1, 2, 3], [], make_generator(1234))
        tokens = []
        for _ in range(8):
            rows = [row(p) for p in others[:rows_before]] + [seeded] + [row(p) for p in others[rows_before:]]
            result = Sampler([0], vocab)(batch_logits, rows, make_generator(len(tokens)))
            tokens.append(result.token_ids[rows_before])
            seeded.output_token_ids.append(tokens[-1])
        return tokens

    alone = run(target, 0, [])
    others = [
        SamplingParams(temperature=1.2),
        greedy(),
        SamplingParams(min_p=0.1, seed=9),
        SamplingParams(top_p=0.5),
    ]
    noise = torch.randn(len(others), vocab)
    assert run(torch.cat([target, noise]), 0, others) == alone
    assert run(torch.cat([noise[:2], target, noise[2:]]), 2, others) == alone
    assert run(torch.cat([noise, target]), 4, others) == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    torch.manual_seed(8)
    logits = torch.randn(1, 1000)
    sampler = Sampler([0], 1000)

    def tokens(seed: int) -> list[int]:
        r = row(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits, [r]).token_ids[0] for _ in range(10)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_unseeded_rows_use_engine_generator() -> None:
    torch.manual_seed(9)
    logits = torch.randn(4, 500)
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(4)]
    sampler = Sampler([0], 500)
    first = sampler(logits, rows, make_generator(42)).token_ids
    assert sampler(logits, rows, make_generator(42)).token_ids == first


def test_bad_input_clear_errors() -> None:
    sampler = Sampler([0], 10)
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.randn(3, 10), [row(greedy())])
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        sampler(torch.randn(1, 8), [row(greedy())])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler(torch.randn(1, 10), [row(greedy(logit_bias={12: 1.0}))])
    with pytest.raises(InvalidRequestError, match="logit_bias token id 12"):
        check_params_against_vocab(greedy(logit_bias={12: 1.0}), 10)
    with pytest.raises(InvalidRequestError, match="stop_token_ids entry -1"):
        check_params_against_vocab(greedy(stop_token_ids=[-1]), 10)
    check_params_against_vocab(greedy(logit_bias={9: 1.0}, stop_token_ids=[0]), 10)
    assert sampler(torch.randn(0, 10), []).token_ids == []


def test_greedy_path_is_fast_on_full_vocab() -> None:
    # Not a benchmark: relative to one log_softmax over the batch (robust to a busy machine), it guards
    # against per-row Python work or extra full-vocabulary passes on the hot path.
    import time

    torch.manual_seed(10)
    logits = torch.randn(64, 49152)
    rows = [row(greedy()) for _ in range(64)]
    sampler = Sampler([0], 49152)

    def baseline() -> None:
        torch.log_softmax(logits, dim=-1)
        logits.argmax(dim=-1)

    # interleaved best-of timings, so load from other processes hits both sides alike
    base_times, sampler_times = [], []
    for _ in range(9):
        for fn, times in ((baseline, base_times), (lambda: sampler(logits, rows), sampler_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    assert min(sampler_times) < 4 * min(base_times) + 0.005, (min(sampler_times), min(base_times))
    result = sampler(logits, rows)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert not any(math.isnan(v) for v in result.logprobs)


def _reference_kept(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a row may draw, by a float64 full sort: top-k, then top-p on the renormalised rest, then min-p."""
    scaled = logits.double() / p.temperature
    order = scaled.argsort(descending=True, stable=True)
    k = p.top_k if 0 < p.top_k < len(scaled) else len(scaled)
    kept = order[:k]
    probs = torch.softmax(scaled[kept], dim=0)
    before = probs.cumsum(0) - probs
    kept = kept[(before < p.top_p) | (torch.arange(len(kept)) == 0)]
    final = torch.softmax(scaled[kept], dim=0)
    kept = kept[final >= p.min_p * final.max()]
    return set(kept.tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
        SamplingParams(temperature=1.5, top_k=300),
        SamplingParams(temperature=5.0, top_p=0.6),  # flat: the nucleus is far past the first candidates
        SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.99, min_p=0.001),
    ],
)
def test_truncation_matches_full_sort_reference(params: SamplingParams) -> None:
    from engine.sampling.truncation import truncated_probs

    torch.manual_seed(11)
    logits = torch.randn(3, 20000) * 2.5
    mixed = [params, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5)]
    probs = truncated_probs(logits, mixed)
    for i, p in enumerate(mixed):
        assert set(probs[i].nonzero().flatten().tolist()) == _reference_kept(logits[i], p)
        assert probs[i].sum().item() > 0


def test_which_rows_sample_on_the_device():
    """Unseeded draws (temperature, top-k, top-p, min-p) stay with the logits' device; a seeded or
    processed row sends the batch to the host."""

    def row(**kw):
        seed = kw.pop("seed", None)
        return SamplingRow(SamplingParams(**kw), [1, 2], [3], make_generator(seed) if seed is not None else None)

    drawn = [row(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05), row(temperature=0.0)]
    assert Sampler.samples_on_device(drawn)
    assert not Sampler.runs_on_any_device(drawn)  # the greedy fast path is for greedy rows only
    assert not Sampler.samples_on_device([*drawn, row(temperature=0.8, seed=3)])
    assert not Sampler.samples_on_device([*drawn, row(temperature=0.8, repetition_penalty=1.2)])
    assert not Sampler.samples_on_device([*drawn, row(temperature=0.0, logit_bias={5: 1.0})])
    # in flight: nothing read back before the tokens are needed, so no top-p row without top-k
    assert Sampler.draws_in_flight(drawn)
    assert not Sampler.draws_in_flight([*drawn, row(temperature=0.8, top_p=0.9)])
    assert Sampler.draws_in_flight([*drawn, row(temperature=0.0, top_p=0.9)])


def test_top_p_rows_past_the_candidates_are_redone_over_the_vocabulary():
    """A flat row's nucleus (more tokens than the first candidates) and a peaked one in one batch: the
    flat row keeps exactly the tokens a full sort keeps."""
    from engine.sampling.truncation import _TOP_P_CANDIDATES, truncated_probs

    vocab = 3 * _TOP_P_CANDIDATES
    torch.manual_seed(0)
    flat = torch.randn(vocab) * 0.01
    peaked = torch.randn(vocab) * 5
    probs = truncated_probs(torch.stack([flat, peaked]), [SamplingParams(temperature=1.0, top_p=0.9)] * 2)
    for logits, got in zip((flat, peaked), probs):
        ordered = logits.softmax(-1).sort(descending=True)
        before = ordered.values.cumsum(0) - ordered.values
        kept = set(ordered.indices[before < 0.9].tolist())
        assert set(torch.nonzero(got > 0).flatten().tolist()) == kept
