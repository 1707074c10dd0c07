"""Discovery, detection, capabilities, validation, memory queries, threads and GEMM of the CPU plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, CacheConfig, EngineConfig, PluginManager, select_platform
from engine_plugin_cpu import plugin
from engine_plugin_cpu.gemm import CpuGemmBackend
from engine_plugin_cpu.platform import KVCACHE_SPACE_ENV, CpuPlatform, preferred_dtype, read_meminfo_bytes
from engine_plugin_sdk import EagerGraphCapture, QuantizedWeight
from engine_plugin_sdk.testing import build_tiny_llama


def test_entry_point_discovery() -> None:
    manager = PluginManager()
    records = {r.name: r for r in manager.records}
    assert "cpu" in records, f"entry point not found; records: {manager.records}"
    record = records["cpu"]
    assert record.status == "loaded", record.error
    assert record.distribution == "engine-plugin-cpu"
    assert record.platforms == [CpuPlatform]
    assert record.api_spec == plugin.ENGINE_PLUGIN_API


@pytest.mark.parametrize("device", ["cpu", "host", "auto"])
def test_select_platform(device: str) -> None:
    manager = PluginManager(allow=["cpu"])
    assert isinstance(select_platform(device, manager), CpuPlatform)


def test_plugin_module_import_is_cheap() -> None:
    code = (
        "import sys, engine_plugin_cpu.plugin as p; "
        "heavy = [m for m in sys.modules if m.startswith('engine_plugin_cpu.') and m != 'engine_plugin_cpu.plugin']; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_detect_is_available() -> None:
    result = CpuPlatform.detect()
    assert result.available and result.reason == ""
    assert CpuPlatform.name == "cpu" and CpuPlatform.priority == 0


def test_capabilities() -> None:
    caps = CpuPlatform().capabilities()
    assert set(caps.dtypes) == {"float32", "bfloat16"} == set(caps.kv_cache_dtypes)
    assert caps.block_sizes == (8, 16, 32, 64)
    assert {64, 80, 96, 128, 256} <= set(caps.head_sizes)
    assert caps.swap and caps.sliding_window and caps.logits_soft_cap and not caps.graph_capture
    assert caps.attention_sinks and caps.non_causal_attention
    # K-quants are claimed only where the C kernels can be built
    native = {"gguf_q4_k", "gguf_q5_k", "gguf_q6_k", "gguf_q5_1", "gguf_q3_k", "gguf_q2_k"}
    k_quants = native if CpuPlatform().native_kernels_possible() else set()
    grouped = {"int4_grouped", "int8_grouped"}
    repacked = {"gguf_q5_0", "gguf_iq4_nl", "gguf_iq4_xs"}
    assert set(caps.quant_schemes) == {"gguf_q4_0", "gguf_q4_1", "gguf_q8_0"} | repacked | grouped | k_quants
    assert set(caps.quant_schemes) == set(CpuPlatform().make_gemm_backend().supported_quant_schemes)
    # "auto" is the first listed dtype: bf16 only where the CPU has a native bf16 dot product
    assert caps.dtypes[0] == preferred_dtype() == caps.extra["preferred_dtype"]


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_validate_accepts_supported(dtype: str) -> None:
    assert CpuPlatform().validate(EngineConfig(dtype=dtype, cache=CacheConfig(block_size=32))) == []


def test_validate_rejects_unsupported_with_reasons() -> None:
    reasons = CpuPlatform().validate(
        EngineConfig(dtype="float16", cache=CacheConfig(block_size=12, kv_cache_dtype="float8_e4m3fn"))
    )
    assert len(reasons) == 3
    assert any("dtype 'float16'" in r for r in reasons)
    assert any("KV cache dtype 'float8_e4m3fn'" in r for r in reasons)
    assert any("block size 12" in r for r in reasons)
    assert all("\n" not in r for r in reasons)


def test_memory_queries() -> None:
    platform = CpuPlatform()
    total, free = platform.total_memory_bytes(), platform.free_memory_bytes()
    assert 0 < free <= total
    assert total >= 256 * 1024 * 1024


def test_meminfo_parsing(tmp_path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1000 kB\nMemFree:   10 kB\nMemAvailable:    600 kB\n")
    assert read_meminfo_bytes("MemTotal", str(path)) == 1000 * 1024
    assert read_meminfo_bytes("MemAvailable", str(path)) == 600 * 1024
    assert read_meminfo_bytes("Missing", str(path)) is None
    assert read_meminfo_bytes("MemTotal", str(tmp_path / "absent")) is None


def test_thread_count_choice() -> None:
    assert plugin.choose_thread_count({}) == plugin.usable_cores()
    assert plugin.choose_thread_count({"OMP_NUM_THREADS": "1"}) is None
    assert plugin.choose_thread_count({"MKL_NUM_THREADS": "3"}) is None
    assert plugin.choose_thread_count({"ENGINE_CPU_THREADS": "3", "OMP_NUM_THREADS": "1"}) == 3
    with pytest.raises(ValueError, match="ENGINE_CPU_THREADS must be a positive integer"):
        plugin.choose_thread_count({"ENGINE_CPU_THREADS": "many"})


def test_engine_configure_sets_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        monkeypatch.setenv("ENGINE_CPU_THREADS", "1")
        plugin.engine_configure(platform=CpuPlatform(), config=EngineConfig())
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("ENGINE_CPU_THREADS")
        plugin.engine_configure(platform=CpuPlatform(), config=EngineConfig())
        assert torch.get_num_threads() == plugin.usable_cores()
        # a user's OMP_NUM_THREADS wins: nothing changes
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        plugin.engine_configure(platform=CpuPlatform(), config=EngineConfig())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(original)


def test_graph_capture_is_eager() -> None:
    capture = CpuPlatform().make_graph_capture()
    assert isinstance(capture, EagerGraphCapture)
    capture.capture(lambda x: x * 2, [1, 2], lambda n: (torch.ones(n),))
    assert torch.equal(capture.run(3, torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
    assert capture.captured_batch_sizes() == []


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemm_against_float64(dtype: torch.dtype, tol: float, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 80, generator=gen, dtype=torch.float64)
    x = torch.randn(5, 7, 80, generator=gen, dtype=torch.float64)
    bias = torch.randn(96, generator=gen, dtype=torch.float64) if with_bias else None
    gemm = CpuGemmBackend()
    prepared = gemm.prepare_weight(weight, dtype)
    assert prepared.dtype == dtype and prepared.is_contiguous()
    out = gemm.linear(x.to(dtype), prepared, None if bias is None else bias.to(dtype))
    assert out.dtype == dtype and out.shape == (5, 7, 96)
    # the reference uses the same rounded inputs the kernel saw (a bf16 weight is prepacked: opaque)
    ref = torch.nn.functional.linear(
        x.to(dtype).double(), weight.to(dtype).double(), None if bias is None else bias.to(dtype).double()
    )
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, atol=tol * scale, rtol=tol)


def test_gemm_dequantizes_quantized_weights() -> None:
    dense = torch.randn(16, 32)
    qw = QuantizedWeight(scheme="test_q8", data=b"", shape=(16, 32), dequantize=lambda: dense.clone())
    gemm = CpuGemmBackend(prepack=False)  # a plain tensor to compare (a prepacked one is opaque)
    prepared = gemm.prepare_weight(qw, "bfloat16")
    assert prepared.dtype == torch.bfloat16 and torch.equal(prepared, dense.to(torch.bfloat16))
    assert "test_q8" not in gemm.supported_quant_schemes


def test_gemm_rejects_bad_weights() -> None:
    gemm = CpuGemmBackend()
    with pytest.raises(ValueError, match="expected a tensor"):
        gemm.prepare_weight([[1.0]], torch.float32)
    with pytest.raises(ValueError, match="expected floating point"):
        gemm.prepare_weight(torch.ones(2, 2, dtype=torch.int8), torch.float32)
    wrong = QuantizedWeight(scheme="q", data=None, shape=(4, 4), dequantize=lambda: torch.ones(2, 2))
    with pytest.raises(ValueError, match="expected \\(4, 4\\)"):
        gemm.prepare_weight(wrong, torch.float32)


def test_default_kv_budget_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KVCACHE_SPACE_ENV, raising=False)
    platform = CpuPlatform()
    budget = platform.default_kv_cache_bytes()
    assert budget is not None and 0 < budget <= 2 * 1024**3
    assert budget <= platform.free_memory_bytes() // 4


def test_kvcache_space_sets_the_pool_unless_the_engine_names_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_tiny_llama(tmp_path, head_dim=32, seed=int(torch.randint(0, 1000, ())))
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "0.0625")
    per_block = 2 * 2 * 2 * 32 * 16 * 4  # k and v, 2 layers, 2 KV heads, head size 32, 16 tokens, float32
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", max_num_seqs=256)
    assert llm.llm_engine.num_total_blocks == min(2**26 // per_block, 256 * 256 // 16)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_memory_bytes=100 * per_block)
    assert llm.llm_engine.num_total_blocks == 100
