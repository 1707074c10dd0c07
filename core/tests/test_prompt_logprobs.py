"""``prompt_logprobs``: each prompt token's log-probability given the tokens before it, against HF
transformers' float32 log-softmax of the same prompt; whole, in chunks, and past a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch
from dense_model_utils import PROMPTS, load_hf

from engine import LLM, SamplingParams
from engine_test_utils import assert_all_blocks_free

TOP = 3


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=16 << 20, **kwargs)


def _check_against_hf(hf, ids: list[int], prompt_logprobs: list) -> None:
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry, expected = prompt_logprobs[position], reference[position - 1]
        token = ids[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        # the rank up to near-ties: the reference's logprobs are themselves within 1e-4 of the engine's
        surely_above, maybe_above = (int((expected > expected[token] + d).sum()) for d in (1e-4, -1e-4))
        assert surely_above + 1 <= entry[token].rank <= maybe_above + 1
        top = expected.topk(TOP)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
            if tid != token:
                assert entry[tid].rank == rank
        assert len(entry) in (TOP, TOP + 1)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(tiny_llama_dir, hf_llama, chunked):
    extra = dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=8) if chunked else {}
    llm = _llm(tiny_llama_dir, **extra)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for out in outs:
        _check_against_hf(hf_llama, out.prompt_token_ids, out.prompt_logprobs)
    if chunked:  # the same prompts again: their blocks are cached, and still every token is scored
        for out in llm.generate(PROMPTS[:3], params, use_tqdm=False):
            _check_against_hf(hf_llama, out.prompt_token_ids, out.prompt_logprobs)
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert_all_blocks_free(llm)


def test_zero_alternatives_give_just_the_prompt_tokens(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
