"""Which integer-dot GEMV and MoE tiles a GPU gets by its memory bandwidth a multiprocessor
(``engine_plugin_nvidia.gemm``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import engine_plugin_nvidia.gemm as nvidia_gemm
import engine_plugin_nvidia.tuning as nvidia_tuning
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import H200_GROUPED_INT_TILES
from engine_plugin_sdk.gpu.triton_kernels.launch import INTERPRETER_TUNING
from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import H200_MOE_TILES

#: (memory clock kHz, bus bits, SMs) as the drivers report them
H100_SXM = (2_619_000, 5120, 132)
H200 = (3_201_000, 6144, 132)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, clock_khz: int, bus_bits: int, sms: int, capability=(9, 0)) -> None:
    props = SimpleNamespace(memory_clock_rate=clock_khz, memory_bus_width=bus_bits)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    tuning = dataclasses.replace(INTERPRETER_TUNING, num_compute_units=sms)
    monkeypatch.setattr(nvidia_tuning, "tuning_for_device", lambda interpret: tuning)


# an H100 held to 96 SMs (benchmarks/nvidia_sm_partition.py) streams an H200's bytes a multiprocessor
@pytest.mark.parametrize(("gpu", "fast"), [(H100_SXM, False), (H200, True), ((2_619_000, 5120, 96), True)])
def test_tiles_follow_the_bandwidth_a_multiprocessor(monkeypatch: pytest.MonkeyPatch, gpu, fast: bool) -> None:
    fake_gpu(monkeypatch, *gpu)
    per_sm = nvidia_gemm.memory_bytes_per_sm("cuda:0")
    assert per_sm == pytest.approx(2 * gpu[0] * 1e3 * gpu[1] / 8 / gpu[2])
    tiles = nvidia_gemm.CudaGemmBackend("cpu")._grouped_int_tiles()
    if fast:
        assert (tiles.dot_gemv_rows, tiles.dot_gemv_prepared, tiles.dot_gemv_program_params_zero_point) == (16, True, True)
    else:
        assert tiles == H200_GROUPED_INT_TILES
    # everything but the fast-memory choices is the NVIDIA table's
    assert tiles.fragment_rows == H200_GROUPED_INT_TILES.fragment_rows
    assert tiles.dot_gemv_x_rows == H200_GROUPED_INT_TILES.dot_gemv_x_rows
    assert tiles.dot_gemv_x_rows_rows == H200_GROUPED_INT_TILES.dot_gemv_x_rows_rows == 16
    moe = nvidia_gemm.CudaGemmBackend("cpu")._moe_tiles()
    assert moe.down_gemv == ((4, 256, 4) if fast else (4, 1024, 4)) and H200_MOE_TILES.down_gemv == (4, 1024, 4)
    # everything but the down GEMV's tile is the table's
    assert dataclasses.replace(moe, down_gemv=H200_MOE_TILES.down_gemv) == H200_MOE_TILES


def test_unknown_memory_keeps_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, 0, 0, 132)
    monkeypatch.setattr(nvidia_gemm, "_memory_clock_and_bus", lambda index: (0, 0))
    assert nvidia_gemm.memory_bytes_per_sm("cuda:0") is None
    assert nvidia_gemm.CudaGemmBackend("cpu")._grouped_int_tiles() == H200_GROUPED_INT_TILES
    assert nvidia_gemm.CudaGemmBackend("cpu")._moe_tiles() == H200_MOE_TILES


def test_tiles_set_on_the_backend_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, *H200)
    gemm = nvidia_gemm.CudaGemmBackend("cpu")
    gemm.moe_tiles = dataclasses.replace(H200_MOE_TILES, down_gemv=(8, 512, 8))  # a benchmark's or the interpreter's
    assert gemm._moe_tiles().down_gemv == (8, 512, 8)


def test_pre_ampere_gpus_keep_off_the_dot_gemv_whatever_their_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, *H200, capability=(7, 5))
    tiles = nvidia_gemm.CudaGemmBackend("cpu")._grouped_int_tiles()
    assert (tiles.dot_gemv_rows, tiles.fragment_rows, tiles.dot_gemv_prepared) == (0, 0, False)
