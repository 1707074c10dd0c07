"""Stop conditions: EOS, stop tokens, stop strings across tokens, length limits, streaming hold-back."""

from __future__ import annotations

import random

from engine.output.stop import StopChecker, StopDecision
from engine.sampling.params import SamplingParams

EOS = 2


def feed(
    checker: StopChecker, pieces: list[str], prompt_len: int = 3
) -> tuple[StopDecision | None, str, int]:
    """Append one token per text piece (ids 100+i); return the decision, the text and the token count."""
    text = ""
    output: list[int] = []
    for i, piece in enumerate(pieces):
        output.append(100 + i)
        text += piece
        decision = checker.check(output, prompt_len + len(output), text, len(piece))
        if decision is not None:
            return decision, text, len(output)
    return None, text, len(output)


def test_stop_string_spanning_two_tokens() -> None:
    checker = StopChecker(SamplingParams(stop=["END"], max_tokens=50), [EOS], 1000)
    decision, text, n = feed(checker, ["Hello ", "wor", "ld E", "ND tail"])
    assert decision == StopDecision("stop", "END", len("Hello world "))
    assert text[: decision.text_end] == "Hello world "
    assert n == 4


def test_stop_string_at_start() -> None:
    checker = StopChecker(SamplingParams(stop=["Hi"]), [EOS], 1000)
    decision, text, _ = feed(checker, ["Hi", " there"])
    assert decision == StopDecision("stop", "Hi", 0)
    assert text[: decision.text_end] == ""


def test_include_stop_str_in_output_keeps_it_and_cuts_after() -> None:
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    decision, text, _ = feed(StopChecker(params, [EOS], 1000), ["ab", "cEN", "Dxyz"])
    assert decision is not None and decision.stop_reason == "END"
    assert text[: decision.text_end] == "abcEND"


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(SamplingParams(stop=["world", "lo w"]), [EOS], 1000)
    decision, text, _ = feed(checker, ["hello world"])
    assert decision == StopDecision("stop", "lo w", 3)


def test_old_text_is_not_searched_again() -> None:
    # a match must overlap the newest text; "xx" before min_tokens must not fire later
    checker = StopChecker(SamplingParams(stop=["xx"], min_tokens=2), [EOS], 1000)
    decision, _, n = feed(checker, ["axx", "b", "c"])
    assert decision is None and n == 3


def test_stop_string_search_matches_naive_find_on_random_text() -> None:
    rng = random.Random(3)
    for _ in range(300):
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        pieces = ["".join(rng.choice("abcd") for _ in range(rng.randint(0, 3))) for _ in range(12)]
        decision, text, _ = feed(StopChecker(SamplingParams(stop=stops, max_tokens=100), [EOS], 1000), pieces)
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            assert decision is None
            continue
        first = min(i for i, _ in hits)
        assert decision is not None and decision.text_end == first
        assert text[first:].startswith(decision.stop_reason)


def test_eos_stops_unless_ignored_and_never_before_min_tokens() -> None:
    checker = StopChecker(SamplingParams(max_tokens=10), [EOS], 1000)
    assert checker.check([5, EOS], 10, "ab", 0) == StopDecision("stop", None, None)
    ignoring = StopChecker(SamplingParams(max_tokens=10, ignore_eos=True), [EOS], 1000)
    assert ignoring.check([5, EOS], 10, "ab", 0) is None
    early = StopChecker(SamplingParams(max_tokens=10, min_tokens=3), [EOS], 1000)
    assert early.check([5, EOS], 10, "ab", 0) is None
    assert early.check([5, 6, EOS], 10, "ab", 0) == StopDecision("stop", None, None)


def test_eos_text_cut_when_special_tokens_are_shown() -> None:
    checker = StopChecker(SamplingParams(skip_special_tokens=False), [EOS], 1000)
    decision = checker.check([5, EOS], 10, "hi<|endoftext|>", len("<|endoftext|>"))
    assert decision == StopDecision("stop", None, 2)


def test_stop_token_ids() -> None:
    params = SamplingParams(stop_token_ids=[7, 8], max_tokens=10)
    checker = StopChecker(params, [EOS], 1000)
    assert checker.check([5, 8], 10, "ab", 0) == StopDecision("stop", 8, None)
    # its text is cut unless asked to keep it
    assert checker.check([5, 7], 10, "ab!", 1) == StopDecision("stop", 7, 2)
    keep = StopChecker(params.model_copy(update={"include_stop_str_in_output": True}), [EOS], 1000)
    assert keep.check([5, 7], 10, "ab!", 1) == StopDecision("stop", 7, None)
    # ignore_eos does not affect stop tokens
    ignoring = StopChecker(params.model_copy(update={"ignore_eos": True}), [EOS], 1000)
    assert ignoring.check([5, 8], 10, "ab", 0) == StopDecision("stop", 8, None)


def test_length_limits() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3), [EOS], 1000)
    assert checker.check([5, 6], 10, "", 0) is None
    assert checker.check([5, 6, 7], 11, "", 0) == StopDecision("length", None, None)
    # the context limit counts prompt plus output, and holds even below max_tokens or min_tokens
    limited = StopChecker(SamplingParams(max_tokens=100, min_tokens=50), [EOS], 12)
    assert limited.check([5], 11, "", 0) is None
    assert limited.check([5, 6], 12, "", 0) == StopDecision("length", None, None)
    unbounded = StopChecker(SamplingParams(max_tokens=None), [EOS], 20)
    assert unbounded.check([5] * 15, 19, "", 0) is None
    assert unbounded.check([5] * 16, 20, "", 0) == StopDecision("length", None, None)
    # a stop beats length when both happen on the same token
    both = StopChecker(SamplingParams(max_tokens=2), [EOS], 1000)
    assert both.check([5, EOS], 10, "", 0) == StopDecision("stop", None, None)


def test_streamable_len_holds_back_partial_stop_prefix() -> None:
    checker = StopChecker(SamplingParams(stop=["</answer>", "STOP"]), [EOS], 1000)
    assert checker.streamable_len("The result is </ans") == len("The result is ")
    assert checker.streamable_len("Go ST") == len("Go ")
    assert checker.streamable_len("Go S") == len("Go ")
    assert checker.streamable_len("A <b>") == len("A <b>")  # "<b>" starts no stop string
    assert checker.streamable_len("no stop here") == len("no stop here")
    assert checker.streamable_len("") == 0
    # nothing held back without stop strings, or when the stop string would be shown anyway
    assert StopChecker(SamplingParams(), [EOS], 1000).streamable_len("abc </ans") == 9
    keep = StopChecker(SamplingParams(stop=["STOP"], include_stop_str_in_output=True), [EOS], 1000)
    assert keep.streamable_len("Go ST") == 5


def test_streamed_text_is_never_retracted() -> None:
    rng = random.Random(5)
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 4)))]
        checker = StopChecker(SamplingParams(stop=stops, max_tokens=100), [EOS], 1000)
        text, shown, output = "", 0, []
        for i in range(15):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            text += piece
            output.append(i)
            decision = checker.check(output, len(output), text, len(piece))
            if decision is not None:
                assert decision.text_end is not None and decision.text_end >= shown
                break
            shown = max(shown, checker.streamable_len(text))
