"""Speculative decoding with a draft model: greedy tokens identical with and without it on a mixed batch
(a draft that agrees now and then, under chunked prefill), every proposal of a draft equal to the target
accepted, the draft's and the target's KV blocks all free afterwards, and one-line errors for a draft
that cannot serve the target."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from dense_model_utils import PROMPTS

from engine import LLM, SamplingParams
from engine.errors import EngineConfigError
from engine_test_utils import assert_all_blocks_free

KV = 16 << 20


@pytest.fixture(scope="module")
def near_draft_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """The tiny Llama with noise on every matrix: its greedy choice agrees with the target's often, not
    always, so verification both accepts and rejects."""
    from transformers import LlamaForCausalLM

    out = str(tmp_path_factory.mktemp("near-draft"))
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * 0.03)
    model.save_pretrained(out)
    for name in os.listdir(tiny_llama_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(tiny_llama_dir, name), out)
    return out


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_draft_free(llm: LLM) -> None:
    draft = llm.llm_engine.speculator.draft
    assert draft is not None and not draft.mirrors
    bm = draft.parts.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_greedy_tokens_are_unchanged_with_a_draft_that_agrees_now_and_then(tiny_llama_dir, near_draft_dir):
    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=KV)
    prompts = PROMPTS[:5]
    expected = _greedy(LLM(**kwargs), prompts)
    spec = LLM(
        **kwargs, max_num_batched_tokens=16,
        speculative_config={"model": near_draft_dir, "num_speculative_tokens": 3, "auto_disable": False},
    )  # fmt: skip
    assert _greedy(spec, prompts) == expected
    stats = spec.llm_engine.stats()
    assert stats["spec_method"] == "draft_model"
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_proposed_tokens"]
    assert_all_blocks_free(spec)
    _assert_draft_free(spec)


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(tiny_llama_dir):
    kwargs = dict(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=KV)
    prompts = PROMPTS[:3]
    expected = _greedy(LLM(**kwargs), prompts, 17)
    spec = LLM(
        **kwargs,
        speculative_config={"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 4, "auto_disable": False},
    )
    assert _greedy(spec, prompts, 17) == expected
    stats = spec.llm_engine.stats()
    assert stats["spec_num_proposed_tokens"] > 0
    assert stats["spec_acceptance_rate"] == 1.0
    # 17 tokens: the prefill's, three verified steps of 4 proposals and a bonus token, then one plain decode
    # (a last token leaves no room to propose)
    assert stats["spec_mean_accepted_length"] == 5.0
    assert stats["spec_num_proposed_tokens"] == 3 * 4 * len(prompts)
    assert_all_blocks_free(spec)
    _assert_draft_free(spec)


def test_a_draft_of_another_architecture_keeps_sampled_requests_running(tiny_llama_dir, tiny_qwen2_dir):
    """A Qwen2 draft for a Llama target: seeded sampling is reproducible, and stop by EOS, max_tokens and
    aborts leave no block behind in either pool."""
    spec = LLM(
        model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=KV,
        speculative_config={"model": tiny_qwen2_dir, "num_speculative_tokens": 2},
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    first = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert first == again and all(first)
    assert_all_blocks_free(spec)
    _assert_draft_free(spec)


def test_a_draft_that_cannot_serve_the_target_is_a_one_line_error(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = str(tmp_path / "wide-vocab")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=50000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )).save_pretrained(wide)  # fmt: skip
    for config, message in (
        ({"model": wide, "num_speculative_tokens": 2}, "vocabulary \\(50000 tokens\\) is larger than the target's"),
        ({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}, "speculative_config model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's model"),
        ({"method": "ngram", "model": tiny_llama_dir, "num_speculative_tokens": 2}, "model is a setting of method 'draft_model'"),
        ({"model": tiny_llama_dir, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({"model": tiny_llama_dir}, "num_speculative_tokens"),
    ):
        with pytest.raises(ValueError, match=message) as err:
            LLM(model=tiny_llama_dir, device="cpu", kv_cache_memory_bytes=KV, speculative_config=config)
        if isinstance(err.value, EngineConfigError):  # (the others are the configuration's validation errors)
            assert "\n" not in str(err.value)


def test_a_draft_refuses_pipeline_stages(tiny_llama_dir):
    """Checked before any rank starts (tensor parallelism is fine: the driver runs the whole draft)."""
    from engine.config import EngineConfig, ParallelConfig
    from engine.speculative.draft_setup import load_draft

    config = EngineConfig(
        model=tiny_llama_dir, parallel=ParallelConfig(pipeline_parallel_size=2),
        speculative_config={"model": tiny_llama_dir, "num_speculative_tokens": 2},
    )  # fmt: skip
    with pytest.raises(EngineConfigError, match="pipeline parallelism is not supported"):
        load_draft(config, None, None, None)  # type: ignore[arg-type]


def test_cli_names_a_missing_draft_in_one_line(tiny_llama_dir, tmp_path):
    from engine_test_utils import run_cli

    config = '{"model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "no-such-draft")
    result = run_cli("generate", "hello", "--model", tiny_llama_dir, "--device", "cpu", "--speculative-config", config, timeout=300)
    err = result.stderr.strip()
    assert result.returncode == 1
    assert len(err.splitlines()) == 1 and err.startswith("error: speculative_config model"), err


def test_a_mirror_always_feeds_its_last_token_again():
    """The target sampled the draft's own first proposal without verifying it (a step that carried none):
    the mirror already holds that token's KV, but its next forward must still take the token."""
    from types import SimpleNamespace

    from engine.block_manager import BlockManager
    from engine.sequence import Sequence
    from engine.speculative.draft_model import DraftModelProposer

    target = Sequence(7, "r", 0, [1, 2, 3], SamplingParams(max_tokens=8), 0, output_token_ids=[10, 11])
    proposer = DraftModelProposer(SimpleNamespace(block_manager=BlockManager(8, 4)))
    mirror = proposer._sync(target)
    assert (mirror.num_tokens, mirror.num_computed_tokens) == (5, 0)
    mirror.output_token_ids += [12, 13, 14]  # proposals; the KV of all but the last computed
    mirror.num_computed_tokens = 7
    target.output_token_ids.append(12)  # sampled plainly, equal to the first proposal
    mirror = proposer._sync(target)
    assert mirror.output_token_ids == [10, 11, 12] and mirror.num_computed_tokens == 5
    # proposals again, the first accepted, the second rejected: the cache is kept up to the accepted one
    mirror.output_token_ids += [13, 14]
    mirror.num_computed_tokens = 7
    target.output_token_ids += [13, 99]
    mirror = proposer._sync(target)
    assert mirror.output_token_ids == [10, 11, 12, 13, 99] and mirror.num_computed_tokens == 7


def _save_scaled(source: str, out: str, head_scale: float) -> str:
    """``source`` with its LM head scaled: a peakier next-token distribution."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(out)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(source, name), out)
    return out


def test_sampling_at_temperature_one_keeps_the_target_distribution(tiny_llama_dir, tmp_path):
    """Many samples of one prompt's second token at temperature 1, proposed by a draft equal to the target
    (its argmax, accepted with the target's probability of it: here 13-65%, so both branches run) on a target
    whose distribution is peaked enough for that: their frequencies follow the target's own conditional
    distribution (HF's softmax given the prompt and each sample's first token), as closely as plain
    sampling's do."""
    from transformers import LlamaForCausalLM

    target = _save_scaled(tiny_llama_dir, str(tmp_path / "target"), 4.0)
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kwargs = dict(model=target, device="cpu", dtype="float32", kv_cache_memory_bytes=KV, seed=11)
    ids = [1, 450, 3304, 2181]
    # drafted, the second token comes from a verification only if a third follows (a sequence's last token
    # leaves no room to propose); plainly sampled, nothing past the second is read
    drafted_params = SamplingParams(n=120, max_tokens=3, temperature=1.0, ignore_eos=True)
    plain_params = SamplingParams(n=120, max_tokens=2, temperature=1.0, ignore_eos=True)

    def distance(llm: LLM, params: SamplingParams) -> float:
        samples = [c.token_ids for out in llm.generate([ids] * 10, params, use_tqdm=False) for c in out.outputs]
        firsts = sorted({s[0] for s in samples})
        with torch.no_grad():
            rows = hf(torch.tensor([ids + [f] for f in firsts])).logits[:, -1].softmax(-1)
        expected = torch.zeros(rows.shape[-1], dtype=torch.float64)
        seen = torch.zeros_like(expected)
        for s in samples:
            expected += rows[firsts.index(s[0])].double() / len(samples)
            seen[s[1]] += 1 / len(samples)
        return 0.5 * float((seen - expected).abs().sum())

    plain = distance(LLM(**kwargs), plain_params)
    spec = LLM(**kwargs, speculative_config={"model": target, "num_speculative_tokens": 1, "auto_disable": False})
    drafted = distance(spec, drafted_params)
    stats = spec.llm_engine.stats()
    assert stats["spec_num_accepted_tokens"] > 100, {k: v for k, v in stats.items() if k.startswith("spec")}
    assert drafted < max(1.5 * plain, 0.1), (drafted, plain)
    assert_all_blocks_free(spec)
    _assert_draft_free(spec)
