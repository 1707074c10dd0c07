"""The platform's contract pieces: detection, claims, validate(), GEMM, block cache, graphs."""

from __future__ import annotations

import pytest
import torch

from engine_plugin_nvidia.platform import INTERPRET_ENV, CudaPlatform
from engine_plugin_sdk import EngineConfig, KVCacheSpec, TorchBlockCache
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_linear, ref_quantized_linear
from engine_plugin_sdk.tolerances import compare, get_tolerance

HAS_GPU = torch.version.cuda is not None and torch.cuda.device_count() > 0
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (CUDA graphs, FP8 units, NCCL)")



@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> CudaPlatform:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    return CudaPlatform()


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_detect_without_gpu_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    result = CudaPlatform.detect()
    assert not result.available and ("CUDA" in result.reason or "GPU" in result.reason)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert CudaPlatform.detect().available


def test_claims_and_validate(platform: CudaPlatform) -> None:
    caps = platform.capabilities()
    assert {16, 32} <= set(caps.block_sizes) and {64, 128} <= set(caps.head_sizes)
    assert platform.validate(EngineConfig(dtype=caps.dtypes[0])) == []
    reasons = platform.validate(EngineConfig(dtype=caps.dtypes[0], cache={"block_size": 24}))
    assert len(reasons) == 1 and "block size 24" in reasons[0]
    # the interpreter converts to FP8 wrongly, so only a GPU with FP8 units claims an FP8 KV cache
    fp8_kv = platform.validate(EngineConfig(dtype=caps.dtypes[0], cache={"kv_cache_dtype": "fp8"}))
    assert bool(fp8_kv) == platform.interpret
    assert platform.validate_head_size(72) and not platform.validate_head_size(128)
    # the shared Triton attention honours causal=False (encoder steps), interpreted or compiled
    assert caps.non_causal_attention
    if platform.interpret:
        # the grouped-integer GEMM / GEMV run in the interpreter too, and with them the GGUF types they
        # take packed; FP8 does not
        assert "bfloat16" not in caps.dtypes and not caps.graph_capture
        assert caps.quant_schemes == (
            "int4_grouped", "int8_grouped", "gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k",
            "gguf_q5_0", "gguf_q5_1", "gguf_q5_k", "gguf_q3_k", "gguf_q2_k", "gguf_iq4_nl", "gguf_iq4_xs",
        )  # fmt: skip
        assert any("bfloat16" in r for r in platform.validate(EngineConfig(dtype="bfloat16")))


def test_dense_and_fp8_gemm(device: torch.device) -> None:
    from engine_plugin_nvidia.gemm import CudaGemmBackend, Fp8Weight

    gemm = CudaGemmBackend(device, fp8=True)
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 4, 256, generator=gen).to(dtype).to(device)
        bias = torch.randn(96, generator=gen).to(dtype).to(device)
        w = (torch.randn(96, 256, generator=gen) / 16).to(dtype).to(device)
        assert not compare(gemm.linear(x, gemm.prepare_weight(w, dtype), bias), ref_linear(x, w, bias), get_tolerance(dtype), "dense")
        for per_tensor in (False, True):
            qw = make_quantized_weight("fp8_e4m3", 96, 256, seed=4, device=device)
            if per_tensor:
                qw.extra["scale"] = qw.extra["scale"].max()
                data = qw.data
                qw.dequantize = lambda d=data, s=qw.extra["scale"]: d.float() * s
            prepared = gemm.prepare_weight(qw, dtype)
            assert isinstance(prepared, Fp8Weight)
            got = gemm.linear(x, prepared, bias)
            assert got.dtype == dtype
            want = ref_quantized_linear(x, qw, bias)
            assert not compare(got, want, get_tolerance(dtype, quantized=True), f"fp8 per_tensor={per_tensor}")


def test_fp8_refused_without_units_falls_back_to_dense(device: torch.device) -> None:
    from engine_plugin_nvidia.gemm import CudaGemmBackend

    gemm = CudaGemmBackend(device, fp8=False)
    assert "fp8_e4m3" not in gemm.supported_quant_schemes
    prepared = gemm.prepare_weight(make_quantized_weight("fp8_e4m3", 32, 64, device=device), torch.float32)
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.float32
    with pytest.raises(ValueError, match="expected a float tensor"):
        gemm.prepare_weight(torch.ones(4, 4, dtype=torch.int32), torch.float32)


def test_typed_factories_build_this_plugins_pieces(platform: CudaPlatform) -> None:
    from engine_plugin_nvidia.attention import TritonAttentionBackend
    from engine_plugin_nvidia.communicator import NcclCommunicator
    from engine_plugin_nvidia.gemm import CudaGemmBackend
    from engine_plugin_nvidia.graph_capture import CudaGraphCapture
    from engine_plugin_sdk import EagerGraphCapture

    assert platform.attention_backend_class() is TritonAttentionBackend
    assert platform.gemm_backend_class() is CudaGemmBackend
    assert platform.graph_capture_class() is CudaGraphCapture
    assert platform.communicator_class() is NcclCommunicator
    assert type(platform.make_attention_backend()) is TritonAttentionBackend
    assert platform.make_attention_backend().tuning is platform.kernel_tuning()
    assert type(platform.make_gemm_backend()) is CudaGemmBackend
    # the interpreter records no graphs: the eager fallback
    assert isinstance(platform.make_graph_capture(), EagerGraphCapture) == platform.interpret


def test_communicator_is_the_sdks_and_needs_a_gpu(platform: CudaPlatform) -> None:
    from engine_plugin_nvidia.communicator import NcclCommunicator
    from engine_plugin_sdk import Communicator, TorchDistributedCommunicator

    assert issubclass(NcclCommunicator, TorchDistributedCommunicator) and issubclass(NcclCommunicator, Communicator)
    assert NcclCommunicator.backend == "nccl"
    # the interpreter has no GPU for NCCL: not claimed, and refused as the contract says; a GPU claims it
    assert platform.capabilities().distributed == (not platform.interpret)
    if platform.interpret:
        with pytest.raises(NotImplementedError, match="interpreter mode"):
            platform.make_communicator(2, 0, "tcp://127.0.0.1:1")
    if not HAS_GPU:
        with pytest.raises(RuntimeError, match="has no GPU"):
            NcclCommunicator(1, 0, "tcp://127.0.0.1:1")


def test_each_rank_drives_its_own_gpu(platform: CudaPlatform, monkeypatch: pytest.MonkeyPatch) -> None:
    if HAS_GPU:  # a rank on this host's only GPU
        platform.use_device(0)
        assert platform.torch_device() == torch.device("cuda", 0)
        return
    # the interpreter runs every rank on the host
    platform.use_device(3)
    assert platform.torch_device() == torch.device("cpu")
    gpu = CudaPlatform()
    gpu.interpret = False  # as on a host with two GPUs, without touching CUDA
    picked: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    gpu.use_device(1)
    assert gpu.torch_device() == torch.device("cuda", 1) and picked == [1]
    with pytest.raises(RuntimeError, match="there is no GPU 2 here"):
        gpu.use_device(2)


def test_block_cache_copy_and_swap(platform: CudaPlatform) -> None:
    backend = platform.make_attention_backend()
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    pool = platform.make_block_cache(spec, 12, backend)
    # the SDK's pool, page-locking its host blocks on a GPU only
    assert isinstance(pool, TorchBlockCache) and pool.device == platform.torch_device()
    assert pool.host_pool.is_pinned() == (not platform.interpret)
    for cache in pool.kv_caches:
        cache.copy_(torch.randn(cache.shape).to(cache.dtype))
    original = pool.pool.clone()
    pool.copy_blocks([(1, 2), (3, 1)])  # reads happen before writes
    assert torch.equal(pool.pool[:, :, 2], original[:, :, 1]) and torch.equal(pool.pool[:, :, 1], original[:, :, 3])
    pool.swap_out([(4, 0)])
    pool.pool[:, :, 4].zero_()
    pool.swap_in([(0, 5)])
    assert torch.equal(pool.pool[:, :, 5], original[:, :, 4])
    with pytest.raises(ValueError, match="destination block ids"):
        pool.copy_blocks([(0, 99)])


@requires_gpu
def test_cuda_graph_replay_reads_new_inputs() -> None:
    from engine_plugin_nvidia.graph_capture import CudaGraphCapture

    capture = CudaGraphCapture()

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) + 1

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 32, device="cuda"), torch.randn(32, 32, device="cuda")

    capture.capture(step, [1, 4], make)
    assert capture.captured_batch_sizes() == [1, 4] and capture.report is not None
    for n in (4, 1, 4, 3):
        x, w = make(n)
        torch.testing.assert_close(capture.run(n, x, w).clone(), step(x, w))


def test_a_gpu_takes_larger_steps_than_the_interpreter(platform: CudaPlatform) -> None:
    # 8192-token steps under serving load on an H200 (BENCHMARKS.md); the interpreter keeps the core's default
    assert platform.default_max_num_batched_tokens() == (None if platform.interpret else 8192)
