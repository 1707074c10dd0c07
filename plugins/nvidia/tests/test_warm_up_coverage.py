"""The start-up warm-up launches every kernel variant that serving launches afterwards, checked without a GPU.

On a GPU a variant Triton has not compiled yet stalls the step that first needs it (``test_no_compiles_mid_serving``
checks that there). The interpreter compiles nothing, so here each launch's specialization (the kernel, its
constexpr values, its arguments' dtypes, the integers Triton specializes on being 1 or a multiple of 16, its
launch options) is recorded instead: the set a serving run launches (a constrained request's token mask too) must
lie within the warm-up's. The
interpreter's tuning decides the launches, with the GPUs' two-KV-heads decode programs on (over any cache): with
four compute units and two KV heads, a mixed step's leading decode rows take the decode kernel from 4 rows on, two
heads a program from 8, as a GPU's do from 33 and 66 rows over an FP8 cache. The models have one layer: a second
one launches the same specializations again.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from engine_plugin_nvidia.platform import INTERPRET_ENV, CudaPlatform
from engine_plugin_sdk.gpu.triton_kernels.launch import INTERPRETER_TUNING
from engine_plugin_sdk.testing import VOCAB, build_tiny_llama

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
pytestmark = pytest.mark.skipif(HAS_GPU, reason="the interpreter's launches are recorded; a GPU compiles them")

#: launch options that are not kernel arguments but select a compiled variant
OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")


def specialization(fn: object, args: tuple, kwargs: dict) -> tuple:
    """What Triton would key a compiled variant of ``fn`` (an interpreted kernel) on for this launch."""
    params = inspect.signature(fn.fn).parameters  # type: ignore[attr-defined]
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    unspecialized = set(fn.kwargs.get("do_not_specialize") or ())  # type: ignore[attr-defined]
    key: list[tuple] = []
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype)))
        elif isinstance(value, bool) or not isinstance(value, int) or name in unspecialized:
            key.append((name, type(value).__name__))
        else:
            key.append((name, "1" if value == 1 else "16" if value % 16 == 0 else "int"))
    return (fn.fn.__name__, tuple(key), tuple((k, kwargs[k]) for k in OPTIONS if k in kwargs))  # type: ignore[attr-defined]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple]]:
    """The specializations of every interpreted kernel launch from now on (the set grows as kernels run)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[tuple] = set()
    run = InterpretedFunction.run

    def recorded(self: InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        seen.add(specialization(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    yield seen


def assert_launched_only_what_was_warmed(launches: set[tuple], warmed: set[tuple]) -> None:
    """Every specialization launched since the warm-up was launched by it too."""
    missed = sorted(launches - warmed)
    assert not missed, f"launched while serving but not in the warm-up: {missed}"


def claim_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """This plugin in the interpreter, claiming the warm-up as on a GPU (the interpreter claims none: it
    compiles nothing), with the GPUs' two-KV-heads decode programs on."""
    monkeypatch.setenv(INTERPRET_ENV, "1")
    claims = CudaPlatform.capabilities
    monkeypatch.setattr(CudaPlatform, "capabilities", lambda self: dataclasses.replace(claims(self), warm_up=True))
    paired = dataclasses.replace(INTERPRETER_TUNING, decode_paired_fp8=(16, 4, 1), decode_paired_any_cache=True)
    monkeypatch.setattr(CudaPlatform, "kernel_tuning_for_device", lambda self, interpret: paired)


@pytest.mark.slow
def test_serving_launches_only_what_the_warm_up_launched(
    tmp_path: Path, launches: set[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    claim_warm_up(monkeypatch)
    build_tiny_llama(tmp_path, head_dim=64, num_layers=1)
    llm = LLM(
        model=str(tmp_path), device="cuda", dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_seqs=12,
        max_num_batched_tokens=64, max_model_len=64,
    )  # fmt: skip
    warmed = set(launches)
    decode_programs = {dict(key)["KV_HEADS"] for name, key, _ in warmed if name == "paged_decode_kernel"}
    assert decode_programs == {1, 2}, decode_programs
    launches.clear()
    rng = random.Random(0)
    # prompts of several lengths arriving together: chunked prompts beside a varying number of decodes,
    # sequences finishing at staggered steps
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(14)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True) for _ in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    # and a constrained request: structured output's token mask
    choice = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["w5", "w7"]))
    assert llm.generate([prompts[0]], choice, use_tqdm=False)[0].outputs[0].text.strip() in ("w5", "w7")
    assert any(name == "apply_token_bitmask_kernel" for name, _, _ in launches)
    served = {dict(key)["KV_HEADS"] for name, key, _ in launches if name == "paged_decode_kernel"}
    assert served == {1, 2}, served  # both kinds of decode program ran while serving too
    assert_launched_only_what_was_warmed(launches, warmed)


@pytest.mark.slow
def test_adapter_requests_launch_only_what_the_warm_up_launched(
    tmp_path: Path, launches: set[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_adapters import save_adapter

    claim_warm_up(monkeypatch)
    build_tiny_llama(tmp_path / "base", head_dim=64, num_layers=1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    adapter = save_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), 1, r=8, lora_alpha=16, target_modules=targets)
    llm = LLM(
        model=str(tmp_path / "base"), device="cuda", dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_seqs=8,
        max_num_batched_tokens=64, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    warmed = set(launches)
    launches.clear()
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # every other request through the adapter: steps mixing adapter rows with plain ones
    requests = [LoRARequest("a", 1, adapter) if i % 2 else None for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert {"lora_shrink_kernel", "lora_expand_kernel"} <= {name for name, _, _ in launches}
    assert_launched_only_what_was_warmed(launches, warmed)


@pytest.mark.slow
def test_moe_serving_launches_only_what_the_warm_up_launched(
    tmp_path: Path, launches: set[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a mixture of experts picks its kernels by the step's token-expert pairs (the GEMV for a few, then grouped
    # GEMM tiles by their count, as on a GPU: here 16 / 64 pairs, a GPU's 64 / 2,048 / 8,192), and Triton
    # specializes the grouped GEMM's integers (the pairs' count among them) on being a multiple of 16: every
    # tile class must have run with either kind
    from dense_model_utils import save_tiny_with_a_llama_tokenizer

    from engine_plugin_sdk.gpu.triton_kernels import moe_launchers

    claim_warm_up(monkeypatch)
    tiles = dataclasses.replace(
        moe_launchers.INTERPRETER_MOE_TILES, gemv_max_slots=16, gemm=((64, 16, 16, 16, 4, 1), (0, 32, 16, 16, 4, 1))
    )
    monkeypatch.setattr(moe_launchers, "INTERPRETER_MOE_TILES", tiles)
    path = save_tiny_with_a_llama_tokenizer(
        "Qwen3MoeForCausalLM", str(tmp_path), vocab_size=VOCAB, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, hidden_size=64, num_hidden_layers=1,
    )  # fmt: skip
    llm = LLM(
        model=path, device="cuda", dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_seqs=8,
        max_num_batched_tokens=64, max_model_len=64,
    )  # fmt: skip
    warmed = set(launches)
    # the grouped GEMM's tiles, and the router's GEMV with the norm before it at one row
    assert {"moe_gemm_kernel", "add_rms_norm_gemv_kernel"} <= {name for name, _, _ in warmed}
    launches.clear()
    rng = random.Random(3)
    # alone (steps of one prompt: 40, 54 and 90 pairs), then together beside decodes
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (20, 27, 45, 3, 12, 60, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for one in prompts[:3]:
        llm.generate([one], params, use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert {"moe_gemm_kernel", "add_rms_norm_gemv_kernel"} <= {name for name, _, _ in launches}
    assert_launched_only_what_was_warmed(launches, warmed)
