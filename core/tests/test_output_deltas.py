"""Outputs sent as deltas between the engine core's process and the server's rebuild the very outputs the
engine made: growing, cut back by a stop string, replaced (beam search), with logprobs, prompt logprobs,
several completions, pooling outputs, and across a pickle."""

from __future__ import annotations

import pickle
import random

import pytest

from engine.output_deltas import OutputDelta, OutputDeltaDecoder, OutputDeltaEncoder
from engine.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput


def _entry(rng: random.Random) -> dict[int, Logprob]:
    return {rng.randrange(1000): Logprob(-rng.random(), rng.randrange(1, 5), chr(97 + rng.randrange(26)))}


def _random_run(rng: random.Random, request_id: str, steps: int) -> list[RequestOutput]:
    """One request's cumulative outputs over ``steps`` steps, built as the engine does (new lists each
    step, logprob entries shared between steps), with occasional cuts and replacements."""
    n = rng.randrange(1, 4)
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    entries: list[list[dict[int, Logprob]]] = [[] for _ in range(n)]
    prompt_entries: list[dict[int, Logprob] | None] = [None]
    prompt = "the prompt" if rng.random() < 0.5 else None
    outputs = []
    for step in range(steps):
        last = step == steps - 1
        for i in range(n):
            roll = rng.random()
            if roll < 0.1 and texts[i]:
                texts[i] = texts[i][: rng.randrange(len(texts[i]))]  # a stop string cut off
            elif roll < 0.15:
                ids[i] = [rng.randrange(1000) for _ in range(rng.randrange(4))]  # a beam replaced
                entries[i] = [_entry(rng) for _ in ids[i]]
            else:
                for _ in range(rng.randrange(1, 3)):
                    ids[i].append(rng.randrange(1000))
                    entries[i].append(_entry(rng))
                texts[i] += "".join(chr(97 + rng.randrange(26)) for _ in range(rng.randrange(0, 4)))
        if step < 3:
            prompt_entries.append(_entry(rng))
        outputs.append(RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=[5, 6, 7],
            outputs=[
                CompletionOutput(i, texts[i], list(ids[i]), -rng.random(), list(entries[i]),
                                 "stop" if last else None, "x" if last and i == 0 else None)
                for i in range(n)
            ],
            finished=last,
            num_cached_tokens=rng.randrange(3),
            prompt_logprobs=list(prompt_entries),
        ))  # fmt: skip
    return outputs


@pytest.mark.parametrize("seed", range(5))
def test_interleaved_requests_round_trip_through_pickle(seed):
    rng = random.Random(seed)
    runs = {f"r{i}": _random_run(rng, f"r{i}", rng.randrange(1, 30)) for i in range(6)}
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    cursors = dict.fromkeys(runs, 0)
    while cursors:
        rid = rng.choice(sorted(cursors))
        original = runs[rid][cursors[rid]]
        delta = pickle.loads(pickle.dumps(encoder.encode(original)))
        rebuilt = decoder.decode(delta)
        assert rebuilt == original
        assert rebuilt is not original and rebuilt.outputs[0].token_ids is not original.outputs[0].token_ids
        cursors[rid] += 1
        if cursors[rid] == len(runs[rid]):
            del cursors[rid]
    # finished requests leave no state on either side
    assert not encoder._last and not decoder._last


def test_a_growing_output_sends_only_its_new_tokens_and_text():
    encoder = OutputDeltaEncoder()
    first = RequestOutput("a", "p", [1, 2], [CompletionOutput(0, "Hel", [10, 11])])
    second = RequestOutput("a", "p", [1, 2], [CompletionOutput(0, "Hello", [10, 11, 12])])
    encoder.encode(first)
    delta = encoder.encode(second)
    assert isinstance(delta, OutputDelta)
    assert delta.prompt is None  # sent with the first delta only
    assert delta.completions[0][1:5] == (3, "lo", 2, [12])


def test_pooling_outputs_pass_whole_and_aborted_requests_are_forgotten():
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    pooled = PoolingRequestOutput("e", [1, 2], PoolingOutput([0.5, 0.5]))
    assert decoder.decode(encoder.encode(pooled)) is pooled
    running = RequestOutput("a", None, [1], [CompletionOutput(0, "x", [3])])
    decoder.decode(encoder.encode(running))
    encoder.forget(["a"])
    decoder.forget("a")
    assert not encoder._last and not decoder._last
    follow_up = OutputDelta("b", False, 0, [])
    with pytest.raises(KeyError):
        decoder.decode(follow_up)  # a follow-up for a request it never saw
