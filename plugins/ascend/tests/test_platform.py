"""Capability claims, validate(), the factories, the kernel-module contract, GEMM, block cache, communicator."""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine import CacheConfig, EngineConfig
from engine_plugin_ascend import kernel_switch, npu_kernels, reference_kernels
from engine_plugin_ascend.communicator import AscendCommunicator
from engine_plugin_ascend.gemm import AscendGemmBackend
from engine_plugin_ascend.platform import AscendPlatform
from engine_plugin_sdk import (
    CORE_OP_NAMES,
    AttentionBackend,
    BlockCache,
    GemmBackend,
    GraphCapture,
    KVCacheSpec,
    QuantizedWeight,
    TorchBlockCache,
)
from engine_plugin_sdk.reference_ops import ref_linear


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> AscendPlatform:
    monkeypatch.setenv(kernel_switch.KERNELS_ENV, kernel_switch.REFERENCE_KERNELS)
    return AscendPlatform()


def test_capability_claims(platform: AscendPlatform) -> None:
    caps = platform.capabilities()
    # the fused attention takes fp16/bf16 only; no float32 claim
    assert caps.dtypes == ("bfloat16", "float16") == caps.kv_cache_dtypes
    assert caps.block_sizes == (128,)
    assert {64, 128, 256} <= set(caps.head_sizes) and all(h % 16 == 0 for h in caps.head_sizes)
    assert caps.swap and not caps.graph_capture  # see platform.capabilities: host lengths in graphs
    assert not caps.sliding_window and not caps.logits_soft_cap and caps.quant_schemes == ()
    # the fused attention is launched with the causal mask only (see attention_plan)
    assert not caps.attention_sinks and not caps.non_causal_attention
    assert caps.extra["preferred_dtype"] == caps.dtypes[0]
    assert AscendPlatform.name == "npu" and "ascend" in AscendPlatform.aliases and AscendPlatform.priority > 0


def test_capabilities_need_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernel_switch.KERNELS_ENV, raising=False)
    platform = AscendPlatform()  # the suite instantiates every platform, present or not
    assert platform.capabilities().extra["kernels"] == "torch_npu"
    assert "torch_npu" not in sys.modules


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_validate_accepts_claims(platform: AscendPlatform, dtype: str) -> None:
    assert platform.validate(EngineConfig(dtype=dtype, cache=CacheConfig(block_size=128))) == []


def test_validate_rejects_the_rest_in_one_line_each(platform: AscendPlatform) -> None:
    reasons = platform.validate(
        EngineConfig(dtype="float32", cache=CacheConfig(block_size=16, kv_cache_dtype="float8_e4m3fn"))
    )
    assert len(reasons) == 3, reasons
    assert any("dtype 'float32'" in r for r in reasons)
    assert any("block size 16" in r for r in reasons)
    assert any("KV cache dtype 'float8_e4m3fn'" in r for r in reasons)
    mixed = platform.validate(
        EngineConfig(dtype="bfloat16", cache=CacheConfig(block_size=128, kv_cache_dtype="float16"))
    )
    assert mixed == ["KV cache dtype 'float16' must equal the model dtype 'bfloat16' on npu"]
    assert all("\n" not in r for r in reasons + mixed)


def test_factories_and_memory(platform: AscendPlatform) -> None:
    attention = platform.make_attention_backend()
    assert isinstance(attention, AttentionBackend)
    assert isinstance(platform.make_gemm_backend(), GemmBackend)
    assert isinstance(platform.make_graph_capture(), GraphCapture)
    spec = KVCacheSpec(2, 2, 64, 128, torch.bfloat16)
    cache = platform.make_block_cache(spec, 6, attention)
    assert isinstance(cache, BlockCache) and len(cache.kv_caches) == 2
    assert cache.kv_caches[0].shape == (2, 6, 128, 2, 64)
    assert set(platform.op_overrides()) == set(CORE_OP_NAMES)
    assert 0 < platform.free_memory_bytes() <= platform.total_memory_bytes()
    assert 0 < platform.default_kv_cache_bytes() <= 1024**3
    assert platform.capabilities().distributed
    comm = platform.make_communicator(1, 0, "tcp://127.0.0.1:1")  # one rank: no process group
    assert isinstance(comm, AscendCommunicator) and comm.backend == "gloo" and comm.device.type == "cpu"


def test_both_kernel_modules_offer_the_same_api() -> None:
    for name in kernel_switch.KERNEL_API:
        real, substitute = getattr(npu_kernels, name), getattr(reference_kernels, name)
        if callable(real):
            assert (
                inspect.signature(real).parameters.keys() == inspect.signature(substitute).parameters.keys()
            ), name
    assert npu_kernels.DEVICE_TYPE == "npu" and npu_kernels.COMMUNICATOR_BACKEND == "hccl"
    assert kernel_switch.load_kernels("reference") is reference_kernels
    with pytest.raises(ValueError, match="unknown Ascend kernel implementation"):
        kernel_switch.load_kernels("cuda")
    assert kernel_switch.selected_kernels({}) == "torch_npu"
    with pytest.raises(ValueError, match="is not one of"):
        kernel_switch.selected_kernels({kernel_switch.KERNELS_ENV: "npu"})


class RecordingTorchNpu:
    """A fake ``torch_npu`` module that records the calls npu_kernels makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> tuple:
            self.calls.append((name, args, kwargs))
            return (None, None)

        return record


#: keyword parameters of npu_fused_infer_attention_score in torch_npu's documentation
DOCUMENTED_FIA_KEYWORDS = {
    "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table",
    "num_heads", "scale", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads",
    "sparse_mode", "inner_precise", "block_size", "softmax_lse_flag",
}  # fmt: skip


def test_npu_kernels_call_torch_npu_with_documented_names(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    q, k = torch.zeros(2, 3, 4, 64), torch.zeros(5, 128, 128)
    table = torch.zeros(2, 1, dtype=torch.int32)
    npu_kernels.fused_infer_attention_score(
        q, k, k, block_table=table, actual_seq_lengths=[3, 1], actual_seq_lengths_kv=(7, 1), atten_mask=None,
        num_heads=4, num_key_value_heads=2, scale=0.125, input_layout="BSND", sparse_mode=3, block_size=128,
    )  # fmt: skip
    npu_kernels.reshape_and_cache(q, q, k, k, table)
    npu_kernels.swiglu(q)
    names = [c[0] for c in fake.calls]
    assert names == ["npu_fused_infer_attention_score", "_npu_reshape_and_cache", "npu_swiglu"]
    _, args, kwargs = fake.calls[0]
    assert args == (q, k, k) and set(kwargs) <= DOCUMENTED_FIA_KEYWORDS
    assert kwargs["actual_seq_lengths"] == [3, 1] and kwargs["actual_seq_lengths_kv"] == [7, 1]
    assert set(fake.calls[1][2]) == {"key", "value", "key_cache", "value_cache", "slot_indices"}
    assert fake.calls[2][2] == {"dim": -1}


def test_gemm_against_float64(platform: AscendPlatform) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    w, b = torch.randn(16, 32, generator=gen) / 6, torch.randn(16, generator=gen)
    gemm = AscendGemmBackend(torch.device("cpu"))
    out = gemm.linear(x, gemm.prepare_weight(w, "bfloat16"), b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_linear(x, w.bfloat16(), b.bfloat16()), atol=3e-2, rtol=3e-2)
    quant = QuantizedWeight("gguf_q8_0", b"", (16, 32), dequantize=lambda: w)
    assert torch.equal(gemm.prepare_weight(quant, torch.float16), w.half())
    with pytest.raises(ValueError, match="no dequantize"):
        gemm.prepare_weight(QuantizedWeight("gguf_q4_0", b"", (16, 32), dequantize=None), "float16")
    with pytest.raises(ValueError, match="unknown dtype"):
        gemm.prepare_weight(w, "float13")


def test_block_cache_rejects_bad_pairs(platform: AscendPlatform) -> None:
    attention = platform.make_attention_backend()
    pool = platform.make_block_cache(KVCacheSpec(1, 1, 64, 128, torch.float16), 4, attention)
    assert isinstance(pool, TorchBlockCache) and pool.pool.device.type == "cpu"  # the reference substitute
    with pytest.raises(ValueError, match="source block ids"):
        pool.copy_blocks([(4, 0)])
    with pytest.raises(ValueError, match="more than once"):
        pool.copy_blocks([(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="destination block ids"):
        pool.swap_out([(0, 1)])  # one host block by default for 4 device blocks
    with pytest.raises(ValueError, match="at least 1"):
        platform.make_block_cache(KVCacheSpec(1, 1, 64, 128, torch.float16), 0, attention)


def test_communicator_single_rank(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="rank 1 is not in"):
        AscendCommunicator(1, 1, f"file://{tmp_path}/store", kernels=reference_kernels)
    comm = AscendCommunicator(1, 0, f"file://{tmp_path}/store", kernels=reference_kernels)
    try:
        t = torch.randn(4, 4)
        assert torch.equal(comm.all_reduce(t.clone()), t)
        assert torch.equal(comm.all_gather(t), t) and comm.world_size == 1
        assert torch.equal(comm.reduce_scatter(t), t) and torch.equal(comm.all_to_all(t), t)
    finally:
        comm.close()
        comm.close()  # safe twice


def test_communicator_needs_torch_npu_for_hccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # an import of it raises ImportError
    with pytest.raises(RuntimeError, match="HCCL needs torch_npu"):
        AscendCommunicator(2, 0, "tcp://127.0.0.1:1", kernels=npu_kernels)


def test_memory_comes_from_the_npu_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernel_switch.KERNELS_ENV, raising=False)
    platform = AscendPlatform()
    monkeypatch.setattr(platform, "_kernels", SimpleNamespace(mem_get_info=lambda: (40 * 2**30, 64 * 2**30)))
    assert platform.total_memory_bytes() == 64 * 2**30 and platform.free_memory_bytes() == 40 * 2**30
    assert platform.default_kv_cache_bytes() is None  # a fraction of free NPU memory
