"""Incremental detokenisation against tokenizer.decode of the whole output, with SmolLM2's real tokenizer."""

from __future__ import annotations

import os
import random

import pytest

from engine.output.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_gguf_path), gguf_file=os.path.basename(smollm_gguf_path)
    )


@pytest.fixture(scope="module")
def partial_char_tokens(tokenizer) -> list[int]:
    """Tokens whose text alone is not whole UTF-8: byte-level BPE pieces of CJK, emoji and accents."""
    return [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]


def run_incremental(tokenizer, prompt: list[int], output: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = [detok.step(t) for t in output]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces, detok.text


def test_multibyte_text_roundtrip(tokenizer) -> None:
    text = "Hello 世界! Ünïcödé 🙂🎉 naïve café — 日本語のテキスト 👩‍👩‍👧 end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n")
    pieces, full = run_incremental(tokenizer, prompt, ids, skip=True)
    assert full == tokenizer.decode(ids, skip_special_tokens=True) == text
    # no piece ever shows a half character
    assert not any("\ufffd" in p for p in pieces)
    # the emoji's bytes span several tokens: the text appears only when complete
    assert "" in pieces[:-1]


@pytest.mark.parametrize("through", ["hf", "window_decoder"])
def test_fuzz_random_sequences_match_decode(tokenizer, partial_char_tokens: list[int], through: str) -> None:
    from engine.loader.tokenizer import Tokenizer

    # the engine decodes windows through the Rust tokenizer directly; the reference stays HF's decode
    decoder = tokenizer if through == "hf" else Tokenizer(tokenizer).window_decoder()
    assert (decoder is tokenizer) == (through == "hf")
    rng = random.Random(1234)
    vocab = len(tokenizer)
    specials = tokenizer.all_special_ids
    for trial in range(400):
        skip = trial % 2 == 0
        # mostly-partial pools force long runs of unfinished and invalid UTF-8
        partial_share = rng.choice([0.0, 0.3, 0.7, 1.0])

        def pick(partial_share: float = partial_share) -> int:
            r = rng.random()
            if r < partial_share:
                return rng.choice(partial_char_tokens)
            if r < partial_share + 0.03:
                return rng.choice(specials)
            return rng.randrange(vocab)

        output = [pick() for _ in range(rng.randint(1, 80))]
        prompt = [pick() for _ in range(rng.randint(0, 8))]
        _, text = run_incremental(decoder, prompt, output, skip)
        assert text == tokenizer.decode(output, skip_special_tokens=skip), (trial, prompt, output)


def test_special_tokens_kept_or_skipped(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done.", add_special_tokens=False) + [eos]
    _, skipped = run_incremental(tokenizer, [], ids, skip=True)
    _, kept = run_incremental(tokenizer, [], ids, skip=False)
    assert skipped == "Done."
    assert kept == "Done." + tokenizer.decode([eos])


def test_prompt_ending_inside_a_character_gives_no_context(tokenizer) -> None:
    char_ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(char_ids) > 1  # byte-level BPE splits it
    # The prompt ends with the character's first bytes, the output starts with its last: the output
    # text stands on its own, as decode(output) shows it, and does not borrow the prompt's bytes.
    prompt = tokenizer.encode("hi ", add_special_tokens=False) + char_ids[:-1]
    output = char_ids[-1:] + tokenizer.encode("ok", add_special_tokens=False)
    _, text = run_incremental(tokenizer, prompt, output, skip=True)
    assert text == tokenizer.decode(output) == "\ufffdok"


def test_window_stays_bounded(tokenizer, partial_char_tokens: list[int]) -> None:
    rng = random.Random(7)
    ids = tokenizer.encode("The quick brown fox 跳过了 the lazy dog 🐕. " * 40, add_special_tokens=False)
    ids += [rng.choice(partial_char_tokens) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    longest = 0
    for t in ids:
        detok.step(t)
        longest = max(longest, len(detok._ids) - detok._start)
    detok.flush()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert longest <= 40
