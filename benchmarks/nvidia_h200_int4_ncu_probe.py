"""A short program for Nsight Compute: the 4-bit products of Llama-3-8B's gate_up (28,672 x 4,096, groups of
128, one zero point) at one row (the word GEMV) and four rows (the tensor-core kernel), and bf16 cuBLAS at four
rows beside them, each run twice. Profile it on the H200 (hardware counters are read there with the clocks
left alone):

    source benchmarks/nvidia_h200_setup.sh
    ncu --clock-control none -k regex:"grouped_int4|gemv|nvjet|gemm" -c 6 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section SchedulerStats python benchmarks/nvidia_h200_int4_ncu_probe.py > $OUT/ncu.txt
"""

from __future__ import annotations


def main() -> None:
    import torch

    from engine_plugin_sdk.gpu.grouped_codes import GroupedCodes
    from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
        H200_GROUPED_INT_TILES,
        grouped_int_linear,
        pack_grouped_codes,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = 28672, 4096
    codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02 + 0.001).half().float()
    weight = pack_grouped_codes(GroupedCodes(codes, scales, None, 8, 4, 128), 128, torch.device("cuda"))
    one = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    four = torch.randn(4, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    dense = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    for _ in range(2):
        grouped_int_linear(one, weight, None, H200_GROUPED_INT_TILES)
        grouped_int_linear(four, weight, None, H200_GROUPED_INT_TILES)
        torch.nn.functional.linear(four, dense)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
