"""Platform logic without AMD hardware: the HIP build and the device count are simulated at that
boundary only (``torch.version.hip``, ``torch.cuda.device_count`` and the device properties)."""

from __future__ import annotations

import types

import pytest
import torch

from engine_plugin_amd import platform as rocm
from engine_plugin_amd.platform import INTERPRET_ENV, RocmPlatform
from engine_plugin_sdk import EngineConfig

REAL_ROCM = getattr(torch.version, "hip", None) is not None and torch.cuda.device_count() > 0
#: the weight-only schemes the shared Triton GEMM / GEMV run: grouped integers and the GGUF types kept packed
GROUPED_INT_CLAIMS = (
    "int4_grouped", "int8_grouped", "gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k",
    "gguf_q5_0", "gguf_q5_1", "gguf_q5_k", "gguf_q3_k", "gguf_q2_k", "gguf_iq4_nl", "gguf_iq4_xs",
)  # fmt: skip
simulated_only = pytest.mark.skipif(REAL_ROCM, reason="simulates a ROCm host; this one is real")


def fake_rocm(monkeypatch: pytest.MonkeyPatch, devices: int, arch: str = "gfx942:sramecc+:xnack-") -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    props = types.SimpleNamespace(gcnArchName=arch, multi_processor_count=304, total_memory=192 * 1024**3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


@simulated_only
def test_cpu_build_is_unavailable_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    result = RocmPlatform.detect()
    assert not result.available and "torch.version.hip is None" in result.reason


@simulated_only
def test_cuda_build_with_gpus_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.is_available() is True on both builds: only torch.version.hip tells them apart
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    result = RocmPlatform.detect()
    assert not result.available and "a CUDA build" in result.reason


@simulated_only
def test_hip_build_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    fake_rocm(monkeypatch, devices=0)
    result = RocmPlatform.detect()
    assert not result.available and "no AMD GPU" in result.reason and "HIP_VISIBLE_DEVICES" in result.reason
    fake_rocm(monkeypatch, devices=2)
    assert RocmPlatform.detect().available


@simulated_only
def test_detect_does_not_initialise_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    fake_rocm(monkeypatch, devices=1)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("detect() initialised the device")

    monkeypatch.setattr(torch.cuda, "init", forbidden)
    monkeypatch.setattr(torch.cuda, "get_device_properties", forbidden)
    monkeypatch.setattr(torch.cuda, "mem_get_info", forbidden)
    assert RocmPlatform.detect().available


@simulated_only
@pytest.mark.parametrize(
    ("arch", "fp8", "wave"),
    [("gfx942:sramecc+:xnack-", "float8_e4m3fnuz", 64), ("gfx950", "float8_e4m3fn", 64), ("gfx90a", None, 64),
     ("gfx1100", None, 32)],
)  # fmt: skip
def test_capabilities_on_simulated_gpus(monkeypatch: pytest.MonkeyPatch, arch: str, fp8: str | None, wave: int) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    fake_rocm(monkeypatch, devices=1, arch=arch)
    plat = RocmPlatform()
    assert not plat.interpret and plat.torch_device() == torch.device("cuda", 0)
    caps = plat.capabilities()
    assert "bfloat16" in caps.dtypes and caps.graph_capture and caps.swap and caps.distributed
    assert caps.non_causal_attention
    assert plat.arch() == arch.split(":")[0] and plat.wavefront_size() == wave
    assert plat.fp8_dtype() == fp8
    assert caps.quant_schemes == (("fp8_e4m3",) if fp8 else ()) + GROUPED_INT_CLAIMS
    # the labels `engine plugins list` shows say the same
    assert caps.extra == {"gcn_arch": plat.arch(), "wavefront_size": wave, "fp8_dtype": fp8}
    assert plat.validate(EngineConfig(dtype="bfloat16")) == []
    assert plat.total_memory_bytes() == 192 * 1024**3
    tuning = plat.kernel_tuning()
    assert tuning.num_compute_units == 304
    if arch.startswith("gfx94"):
        assert tuning.prefill_tiles(128).block_m == 128 and tuning.decode_num_stages == 1


def test_validate_rejects_what_is_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setattr(rocm, "has_rocm_gpu", lambda: False)
    plat = RocmPlatform()
    assert plat.interpret and RocmPlatform.detect().available
    caps = plat.capabilities()
    assert "bfloat16" not in caps.dtypes and not caps.graph_capture
    assert caps.quant_schemes == GROUPED_INT_CLAIMS
    assert caps.non_causal_attention  # the interpreted Triton attention honours causal=False too
    assert plat.validate(EngineConfig(dtype="float32")) == []
    assert plat.validate(EngineConfig(dtype="auto")) == []
    reasons = plat.validate(EngineConfig(dtype="float32", cache={"block_size": 24}))
    assert len(reasons) == 1 and "block size 24" in reasons[0]
    assert any("bfloat16" in r for r in plat.validate(EngineConfig(dtype="bfloat16")))
    assert plat.validate_head_size(72) and not plat.validate_head_size(128)


def test_rccl_communicator_is_the_sdks_and_checks_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_plugin_amd.communicator import RcclCommunicator
    from engine_plugin_sdk import TorchDistributedCommunicator

    assert issubclass(RcclCommunicator, TorchDistributedCommunicator) and RcclCommunicator.backend == "nccl"
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(RuntimeError, match="RCCL needs a ROCm build"):
        RcclCommunicator(2, 0, "tcp://127.0.0.1:1")
