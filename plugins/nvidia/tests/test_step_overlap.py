"""Dual-batch overlap on this plugin (``enable_dbo``), through the public ``LLM`` API.

In the interpreter the platform's lanes are one queue (``SerialStepOverlap``): the test checks this
plugin's kernels on the nano-batches (half the rows, each half's own block tables and offsets) against
whole steps. On a GPU the lanes are two CUDA streams, eagerly and inside the decode graphs, with and
without SMs left to the attention lane (and its stream at a higher priority): greedy tokens must equal the
whole steps' either way.
"""

from __future__ import annotations

import pytest
import torch
from interpreted_llama import greedy_tokens, tiny_llama_reference

from engine import LLM
from engine_plugin_nvidia.platform import INTERPRET_ENV
from engine_plugin_sdk import Lane

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
PROMPTS = [[1, 5, 9, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 100], [1, 7, 8], [1, 3, 4, 5, 6, 7]]


def generate(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], list[list[int]]]:
    """The tiny Llama's engine settings on this plugin, and its greedy tokens from whole steps (one layer in the
    interpreter, whose lanes are one queue: a second runs the same kernels on the same nano-batches)."""
    layers = 2 if HAS_GPU else 1
    return tiny_llama_reference(tmp_path_factory.mktemp("tiny-llama"), PROMPTS, max_num_seqs=8, num_layers=layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "eager,attention_sms,priority",
    [(True, 0, 0)] + ([(False, 0, 0), (True, 8, -1), (False, 8, -1)] if HAS_GPU else []),
)
def test_overlapped_decode_steps_match_whole_ones(
    tiny_llama: tuple[dict[str, object], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    eager: bool,
    attention_sms: int,
    priority: int,
) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setenv("ENGINE_NVIDIA_DBO_ATTENTION_SMS", str(attention_sms))
    monkeypatch.setenv("ENGINE_NVIDIA_DBO_ATTENTION_PRIORITY", str(priority))
    common, whole = tiny_llama
    # five sequences decode together: steps of 5 rows (2 + 3), later of fewer
    llm = LLM(**common, enforce_eager=eager, enable_dbo=True, dbo_decode_token_threshold=3)
    model = llm.llm_engine.runner.model
    assert model.step_overlap is not None and model.dbo_threshold == 3
    assert generate(llm) == whole
    if HAS_GPU:
        assert (model.step_overlap.attention_sms, model.step_overlap.attention_priority) == (attention_sms, priority)
        assert torch._C._get_sm_carveout_experimental() is None  # each step restores the products' SMs


@pytest.mark.skipif(not HAS_GPU, reason="two CUDA streams need an NVIDIA GPU")
def test_stream_lanes_order_cross_lane_reads() -> None:
    from engine_plugin_sdk.gpu.step_overlap import TorchStreamStepOverlap

    overlap = TorchStreamStepOverlap(0)
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        overlap.begin()
        x = a @ a
        overlap.hand_over(Lane.ATTENTION, [x])
        with overlap.lane(Lane.ATTENTION):
            y = x @ a  # long enough that a read not ordered after it would see stale memory
            y = y @ a
        overlap.hand_over(Lane.COMPUTE, [y])
        z = y.sum()
        overlap.end()
        torch.testing.assert_close(z, ((a @ a) @ a @ a).sum(), rtol=1e-3, atol=1e-1)


def test_stream_lanes_refuse_misuse() -> None:
    from engine_plugin_sdk.gpu.step_overlap import TorchStreamStepOverlap

    with pytest.raises(ValueError, match="attention_sms must be >= 0"):
        TorchStreamStepOverlap(0, attention_sms=-1)
    lanes = TorchStreamStepOverlap(0)
    with pytest.raises(RuntimeError, match="outside begin"):
        lanes.lane(Lane.ATTENTION)
    with pytest.raises(RuntimeError, match="outside begin"):
        lanes.hand_over(Lane.COMPUTE, [])
    with pytest.raises(RuntimeError, match="without begin"):
        lanes.end()
