"""The shared grouped-integer weight-only GEMM and single-row GEMV (``int4_grouped`` / ``int8_grouped``)
against a float64 reference, their load-time packing, split-K, and their place in the NVIDIA GEMM backend
(interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine_plugin_nvidia.gemm as nvidia_gemm
from engine_plugin_nvidia.gemm import CudaGemmBackend
from engine_plugin_nvidia.platform import INTERPRET_ENV, CudaPlatform
from engine_plugin_sdk import QuantizedWeight, dequantize_stored, grouped_int_weight, unpack_int4
from engine_plugin_sdk.gpu.gemm import GROUPED_INT_SCHEMES, GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import grouped_int4_few_rows_launchers as few_rows
from engine_plugin_sdk.gpu.triton_kernels import grouped_int_launchers as launchers
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import (
    dequantize_grouped,
    gemv_subs,
    grouped_int_linear,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_packing import (
    dequantize_packed,
    grouped_int_block_k,
    pack_grouped_codes,
    pack_grouped_int,
)
from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import (
    H200_GROUPED_INT_TILES,
    INTERPRETER_GROUPED_INT_TILES,
    GroupedIntTiles,
)
from engine_plugin_sdk.grouped_codes import GroupedCodes
from engine_plugin_sdk.quant import make_quantized_weight
from engine_plugin_sdk.reference_ops import ref_quantized_linear
from engine_plugin_sdk.tolerances import compare, get_tolerance

OUT = 96  # not a power of two: the last column tile is masked
ROWS = (1, 5, 37)
SCHEMES = ("int4_grouped", "int8_grouped")
#: the GGUF types the GPU backends keep packed in the grouped-integer form
GGUF_PACKED = (
    "gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k", "gguf_q5_0", "gguf_q5_1", "gguf_q5_k", "gguf_q3_k",
    "gguf_q2_k", "gguf_iq4_nl", "gguf_iq4_xs",
)  # fmt: skip
#: small column tiles and a reduction split 3 ways (unevenly: 8 tiles of 32 columns at K=256)
SPLIT_TILES = GroupedIntTiles(
    block_k=32,
    gemm_block_k=32,
    gemm=((0, 16, 64, 4, 1),),
    min_programs=64,
    max_split_k=3,
    min_split_blocks=1,
    gemv=INTERPRETER_GROUPED_INT_TILES.gemv,
    gemv4=INTERPRETER_GROUPED_INT_TILES.gemv4,
)


def tiles_for(device: torch.device) -> GroupedIntTiles:
    return INTERPRETER_GROUPED_INT_TILES if device.type == "cpu" else H200_GROUPED_INT_TILES


def packed(weight: QuantizedWeight, tiles: GroupedIntTiles, device: torch.device) -> GroupedIntWeight:
    bits = 4 if weight.scheme == "int4_grouped" else 8
    block_k = grouped_int_block_k(int(weight.extra["group_size"]), bits, tiles.block_k)
    assert block_k is not None
    return pack_grouped_int(weight, block_k, device)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x[:, perm] @ stored.T + bias``."""
    perm = weight.extra["perm"]
    xs = x.double().cpu()
    if perm is not None:
        xs = xs[:, perm.cpu()]
    y = xs @ dequantize_stored(weight).double().cpu().T
    return y if bias is None else y + bias.double().cpu()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("in_features", "group"), [(256, 128), (64, 32)])
def test_kernel_matches_float64_reference(
    device, kernel_dtypes, scheme: str, in_features: int, group: int
) -> None:
    gen = torch.Generator().manual_seed(in_features + len(scheme))
    tiles = tiles_for(device)
    for case, (with_perm, with_bias) in enumerate(
        [(True, True), (True, False), (False, True), (False, False)]
    ):
        weight = make_quantized_weight(scheme, OUT, in_features, seed=100 + case)
        assert weight.extra["group_size"] == group
        if not with_perm:
            weight.extra["perm"] = None
        prepared = packed(weight, tiles, device)
        for dtype in kernel_dtypes:
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                bias = torch.randn(OUT, generator=gen).to(dtype) if with_bias else None
                got = grouped_int_linear(
                    x.to(device), prepared, None if bias is None else bias.to(device), tiles
                )
                assert got.dtype == dtype and got.shape == (rows, OUT)
                what = f"{scheme} K={in_features} perm={with_perm} bias={with_bias} {dtype} M={rows}"
                # the weight is exact once dequantized: hold the kernel to the dense GEMM's tolerance
                problem = compare(got, reference(x, weight, bias), get_tolerance(dtype), what)
                assert not problem, problem


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tile_k", [32, 64], ids=["block-tiles", "two-block-tiles"])
def test_split_reduction_and_partial_column_tiles(device, scheme: str, tile_k: int) -> None:
    """A reduction split unevenly over programs, with tiles of one packed block of 32 columns or of two (each
    block's scales its own)."""
    gen = torch.Generator().manual_seed(5)
    weight = make_quantized_weight(scheme, OUT, 256, seed=7)
    tiles = dataclasses.replace(SPLIT_TILES, gemm_block_k=tile_k)
    prepared = packed(weight, tiles, device)
    assert prepared.block_k == 32
    for rows in (1, 37):
        x = torch.randn(rows, 256, generator=gen).half()
        bias = torch.randn(OUT, generator=gen).half()
        got = grouped_int_linear(x.to(device), prepared, bias.to(device), tiles)
        assert got.dtype == torch.float16
        problem = compare(
            got, reference(x, weight, bias), get_tolerance(torch.float16), f"{scheme} split M={rows}"
        )
        assert not problem, problem
        logits = grouped_int_linear(x.to(device), prepared, None, tiles, out_dtype=torch.float32)
        assert logits.dtype == torch.float32
        # float32 out, but the product ran in float16: the float16 tolerance
        problem = compare(logits, reference(x, weight, None), get_tolerance(torch.float16), "float32 out")
        assert not problem, problem


@pytest.mark.parametrize("scheme", SCHEMES + ("gguf_q4_k",))
def test_many_rows_run_on_a_dense_copy(device, scheme: str) -> None:
    """From ``dense_rows`` rows on, the weight is dequantized by a kernel into the activations' dtype and
    multiplied by the vendor GEMM: the same products, perm and bias included."""
    gen = torch.Generator().manual_seed(11)
    tiles = dataclasses.replace(tiles_for(device), dense_rows=8)
    weight = make_quantized_weight(scheme, OUT, 256, seed=13)
    # Q4_K: groups of 32 with a zero scale per group, repacked exactly
    prepared = packed(weight, tiles, device) if scheme in SCHEMES else pack_grouped_int(weight, 32, device)
    dense = dequantize_grouped(prepared, torch.float32).cpu()
    exact = dequantize_packed(prepared).cpu()
    if device.type == "cpu":
        assert torch.equal(dense, exact)
    else:
        # a GPU build fuses code * scale - zero_scale into one FMA: one rounding where the reference has two
        # (Q4_K's products are exact, so its copy still equals the reference bit for bit)
        torch.testing.assert_close(dense, exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()))
    assert dequantize_grouped(prepared, torch.float16).dtype == torch.float16
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(37, 256, generator=gen).to(dtype)
        bias = torch.randn(OUT, generator=gen).to(dtype)
        got = grouped_int_linear(x.to(device), prepared, bias.to(device), tiles)
        assert got.dtype == dtype and got.shape == (37, OUT)
        xs = x.double() if prepared.perm is None else x.double()[:, prepared.perm.cpu().long()]
        want = xs @ dequantize_packed(prepared).double().cpu().T + bias.double()
        problem = compare(got, want, get_tolerance(dtype), f"{scheme} dense {dtype}")
        assert not problem, problem


def _int4_groups_of_128(
    gen: torch.Generator, out_features: int, in_features: int, zero_scales: bool, device: torch.device
) -> tuple[GroupedIntWeight, torch.Tensor]:
    """Random 4-bit codes in groups of 128 with act-order, one zero point (8) or zero scales, packed on
    ``device``; and the permutation."""
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // 128, generator=gen) * 0.05 + 0.01
    zs = torch.rand(out_features, in_features // 128, generator=gen) * 0.2 if zero_scales else None
    perm = torch.randperm(in_features, generator=gen)
    unpacked = GroupedCodes(codes, scales, zs, 0 if zero_scales else 8, 4, 128, perm)
    return pack_grouped_codes(unpacked, 128, device), perm


@pytest.mark.parametrize("zero_scales", [False, True], ids=["zero-point", "zero-scales"])
def test_few_rows_run_on_tensor_cores(device, kernel_dtypes, zero_scales: bool, monkeypatch) -> None:
    """2 to ``mma_rows`` 16-bit rows over 4-bit codes take the tensor-core kernel (its PTX on a GPU, plain
    integer ops in the interpreter), split or not, with act-order, bias, and a zero point or zero scales."""
    gen = torch.Generator().manual_seed(17)
    in_features, out_features = 1024, 80
    prepared, perm = _int4_groups_of_128(gen, out_features, in_features, zero_scales, device)
    calls = []
    monkeypatch.setattr(launchers, "mma_linear", lambda *a, _real=launchers.mma_linear: calls.append(1) or _real(*a))
    for programs, splits in ((1, 1), (8, 4)):  # one split, and 8 blocks in 4 splits (80 rows: 2 row tiles)
        # the fragment kernel off: it takes 2-8 rows ahead of this one where it is on
        tiles = dataclasses.replace(tiles_for(device), mma_programs=programs, min_split_blocks=2, fragment_rows=0)
        for dtype in [d for d in kernel_dtypes if d != torch.float32]:
            for rows in (2, 16):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                bias = torch.randn(out_features, generator=gen).to(dtype)
                got = grouped_int_linear(x.to(device), prepared, bias.to(device), tiles)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                want = x.double()[:, perm] @ dequantize_packed(prepared).double().cpu().T + bias.double()
                problem = compare(got, want, get_tolerance(dtype), f"mma {dtype} M={rows} splits={splits}")
                assert not problem, problem
    assert len(calls) == 4 * len([d for d in kernel_dtypes if d != torch.float32])


@pytest.mark.parametrize("zero_scales", [False, True], ids=["zero-point", "zero-scales"])
def test_word_gemv_takes_16_bit_rows_without_a_subtraction(device, kernel_dtypes, zero_scales: bool) -> None:
    """The word GEMV's path for bf16 / fp16 activations (codes at the top of a float's mantissa, the offset
    taken off once a word) against float64, one zero point or zero scales, act-order, bias."""
    gen = torch.Generator().manual_seed(23)
    in_features, out_features = 512, 8
    prepared, perm = _int4_groups_of_128(gen, out_features, in_features, zero_scales, device)
    tiles = dataclasses.replace(tiles_for(device), gemv4=(4, 128, 4, 1))  # two sub-blocks an iteration
    for dtype in [d for d in kernel_dtypes if d != torch.float32]:
        x = torch.randn(1, in_features, generator=gen).to(dtype)
        bias = torch.randn(out_features, generator=gen).to(dtype)
        got = grouped_int_linear(x.to(device), prepared, bias.to(device), tiles)
        want = x.double()[:, perm] @ dequantize_packed(prepared).double().cpu().T + bias.double()
        problem = compare(got, want, get_tolerance(dtype), f"word GEMV {dtype}")
        assert not problem, problem


@pytest.mark.parametrize("scheme", ["w4_g128", "gguf_q4_k"])
def test_gemv_loops_pipelined_past_the_first_tile(device, scheme: str) -> None:
    """The unrolled GEMVs with their reduction loop pipelined (``gemv_loop_stages=3``; the interpreter runs it
    as a plain loop, the GPU through ``cp.async``): the word GEMV (4-bit, blocks of 128) and the byte GEMV
    (Q4_K's 32-column blocks with zero scales), iterations enough that the pipeline fills and drains, a
    partial last one, bf16 / fp16 activations, against float64."""
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int = True
    # 192 bytes a row a step, rounded to a power of two of blocks: 18 blocks of 128 columns (word GEMV, 4 a step)
    # or 72 of 32 (byte GEMV, 16 a step): five steps, the last partial
    weight = make_quantized_weight("int4_grouped" if scheme == "w4_g128" else scheme, 12, 2304, seed=31)
    gemm.grouped_int_tiles = dataclasses.replace(
        tiles_for(device), gemv=(4, 192, 4, 1), gemv4=(4, 192, 4, 1), gemv_loop_stages=3
    )
    for dtype in (torch.bfloat16, torch.float16):
        prepared = gemm.prepare_weight(weight, dtype)
        assert isinstance(prepared, GroupedIntWeight)
        x = torch.randn(1, 2304).to(dtype)
        bias = torch.randn(12).to(dtype)
        got = gemm.linear(x.to(device), prepared, bias.to(device))
        problem = compare(got, ref_quantized_linear(x, weight, bias), get_tolerance(dtype, quantized=True), scheme)
        assert not problem, problem


def test_tensor_core_asm_offsets_are_the_16_bit_floats_it_subtracts() -> None:
    """The asm adds ``sub_bits``' two halves to ``128 + code`` (bf16) or ``1024 + code`` (fp16): they must be
    ``-(128 + offset)`` / ``-(1024 + offset)`` exactly, as a signed int32."""
    for dtype, base in ((torch.bfloat16, 128), (torch.float16, 1024)):
        for offset in (0, 8, 127):
            bits = few_rows.sub_bits(dtype, offset)
            assert -(1 << 31) <= bits < 1 << 31
            halves = torch.tensor([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16)
            assert halves.view(dtype).float().tolist() == [-(base + offset)] * 2
    assert few_rows.sub_bits(torch.bfloat16, 8) == 0xC308C308 - (1 << 32)


def test_int4_codes_pair_within_each_reduction_tile() -> None:
    weight = make_quantized_weight("int4_grouped", 8, 256, seed=3)
    codes = unpack_int4(weight.data)
    prepared = pack_grouped_int(weight, 64, torch.device("cpu"))
    assert prepared.codes.shape == (8, 128) and prepared.codes.dtype == torch.uint8
    low, high = prepared.codes & 0x0F, prepared.codes >> 4
    # byte b * 32 + r of a row: column b * 64 + r low, column b * 64 + 32 + r high
    assert torch.equal(low[:, :32], codes[:, :32]) and torch.equal(high[:, :32], codes[:, 32:64])
    assert torch.equal(low[:, 32:64], codes[:, 64:96]) and torch.equal(high[:, 32:64], codes[:, 96:128])
    scales, zeros = weight.extra["scales"], weight.extra["zeros"]
    # asymmetric zero points and scales that float16 does not hold: both streams, in float32
    assert torch.equal(prepared.scales, scales) and torch.equal(prepared.zero_scales, zeros * scales)
    assert prepared.perm is not None and prepared.perm.dtype == torch.int32


def test_block_k_follows_the_group_size() -> None:
    assert grouped_int_block_k(128, 4, 128) == 128 and grouped_int_block_k(4096, 4, 64) == 64
    assert grouped_int_block_k(96, 4, 128) == 32 and grouped_int_block_k(48, 8, 128) == 16
    assert grouped_int_block_k(48, 4, 128) is None and grouped_int_block_k(8, 8, 128) is None
    with pytest.raises(ValueError, match="does not fit"):
        pack_grouped_int(make_quantized_weight("int8_grouped", 8, 64, seed=1), 64, torch.device("cpu"))


def test_backend_keeps_grouped_weights_quantized(device) -> None:
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int, gemm.grouped_int_tiles = True, tiles_for(device)
    assert gemm.supported_quant_schemes == GROUPED_INT_SCHEMES
    gen = torch.Generator().manual_seed(9)
    for scheme in SCHEMES:
        weight = make_quantized_weight(scheme, OUT, 256, seed=21, device=device)
        prepared = gemm.prepare_weight(weight, torch.float16)
        assert isinstance(prepared, GroupedIntWeight) and prepared.codes.device.type == device.type
        # float32 activations take their own (narrower on a GPU) reduction tile
        assert gemm.prepare_weight(weight, torch.float32).block_k == min(
            gemm.grouped_int_tiles.fp32_block_k, 128
        )
        x = torch.randn(2, 3, 256, generator=gen).half().to(device)
        bias = torch.randn(OUT, generator=gen).half().to(device)
        got = gemm.linear(x, prepared, bias)
        assert got.shape == (2, 3, OUT) and got.dtype == torch.float16
        tol = get_tolerance(torch.float16, quantized=True)
        problem = compare(got, ref_quantized_linear(x, weight, bias), tol, f"{scheme} linear")
        assert not problem, problem
        logits = gemm.logits(x[0], prepared)
        assert logits.dtype == torch.float32
        problem = compare(logits, ref_quantized_linear(x[0], weight), tol, "logits")
        assert not problem, problem


def test_group_sizes_the_kernel_cannot_tile_are_dequantized(device) -> None:
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int, gemm.grouped_int_tiles = True, tiles_for(device)
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (OUT, 64), generator=gen)
    scales, zeros = torch.rand(OUT, 4, generator=gen) / 8, torch.full((OUT, 4), 8.0)
    weight = grouped_int_weight(codes, scales, zeros, 16, 4)  # groups of 16: below a 4-bit tile's 32
    prepared = gemm.prepare_weight(weight, torch.float32)
    assert isinstance(prepared, torch.Tensor) and torch.equal(prepared.cpu(), weight.dequantize())


def test_without_triton_grouped_weights_are_dequantized_at_load() -> None:
    gemm = CudaGemmBackend(torch.device("cpu"))
    assert not gemm.triton_grouped_int and not gemm.supported_quant_schemes
    prepared = gemm.prepare_weight(make_quantized_weight("int8_grouped", 32, 64, seed=2), torch.float32)
    assert isinstance(prepared, torch.Tensor) and prepared.dtype == torch.float32


def test_interpreter_claims_what_its_backend_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    platform = CudaPlatform()
    if not platform.interpret:
        pytest.skip("a GPU is visible: the platform is not in interpreter mode")
    claimed = platform.capabilities().quant_schemes
    assert set(claimed) == {"int4_grouped", "int8_grouped", *GGUF_PACKED}
    assert set(claimed) == set(platform.make_gemm_backend().supported_quant_schemes)


#: the GEMV's outputs: a partial last program at 16, 4 and 2 rows a program (two or more programs at each)
GEMV_OUT = 19


def _gemv_cases() -> list[tuple[str, QuantizedWeight]]:
    """A weight of each form the GEMV specialises on (fresh random values on each call)."""
    seed = int(torch.randint(0, 1 << 30, ()))
    gen = torch.Generator().manual_seed(seed)
    codes4 = torch.randint(0, 16, (GEMV_OUT, 224), generator=gen)
    # fp16-exact scales and one zero point (GPTQ's symmetric form): float16 scales, no zero scales
    symmetric = grouped_int_weight(codes4, (torch.rand(GEMV_OUT, 7, generator=gen) / 8).half().float(),
                                   torch.full((GEMV_OUT, 7), 8.0), 32, 4)  # fmt: skip
    return [
        ("int4 symmetric", symmetric),
        ("int4 act-order", make_quantized_weight("int4_grouped", GEMV_OUT, 256, seed=seed)),
        ("int8 act-order", make_quantized_weight("int8_grouped", GEMV_OUT, 256, seed=seed + 1)),
        *((scheme, make_quantized_weight(scheme, GEMV_OUT, 256, seed=seed + 2)) for scheme in GGUF_PACKED),
    ]


@pytest.mark.parametrize("rows_per_program", [16, 4, 2, 1])
def test_gemv_matches_float64_reference(device, kernel_dtypes, rows_per_program: int) -> None:
    """One activation row through the GEMV: 19 outputs (a partial last program), reductions that the
    iteration width does not divide (masked sub-blocks), perm, bias and float32 logits. Every form through
    the wide (interpreter's) kernel; in the interpreter, the unrolled (GPU's) kernel takes a second per
    program of 4 rows, so it gets a few of the forms there, all of them on a GPU."""
    gemm = CudaGemmBackend(device)
    gemm.triton_grouped_int = True
    cases, dtypes = _gemv_cases(), kernel_dtypes
    if rows_per_program <= 4 and device.type == "cpu":
        # zero scales with perm (4- and 8-bit), Q4_K's zero scales, one zero point (8-bit Q6_K, symmetric 4-bit);
        # float32, and float16 (the unrolled kernels' path for 16-bit activations) at 4 rows and 1
        cases = [cases[i] for i in {4: (1, 6, 7), 2: (2,), 1: (0,)}[rows_per_program]]
        dtypes = [torch.float32] if rows_per_program == 2 else [torch.float32, torch.float16]
    for name, weight in cases:
        for row_bytes in (64, 4096):
            gemv = (rows_per_program, row_bytes, 4, 1)
            tiles = GroupedIntTiles(block_k=128, fp32_block_k=128, gemv=gemv, gemv4=gemv)
            gemm.grouped_int_tiles = tiles
            for dtype in dtypes:
                prepared = gemm.prepare_weight(weight, dtype)
                assert isinstance(prepared, GroupedIntWeight), name
                x = torch.randn(1, weight.shape[1]).to(dtype)
                bias = torch.randn(GEMV_OUT).to(dtype)
                what = f"{name} {dtype} rows={rows_per_program} row_bytes={row_bytes}"
                tol = get_tolerance(dtype, quantized=True)
                got = gemm.linear(x.to(device), prepared, bias.to(device))
                assert got.shape == (1, GEMV_OUT) and got.dtype == dtype
                problem = compare(got, ref_quantized_linear(x, weight, bias), tol, what)
                assert not problem, problem
                logits = gemm.logits(x.to(device), prepared)
                assert logits.dtype == torch.float32
                problem = compare(logits, ref_quantized_linear(x, weight), tol, f"{what} logits")
                assert not problem, problem


def test_gemv_iteration_width(device: torch.device) -> None:
    weight = pack_grouped_int(make_quantized_weight("gguf_q4_k", 8, 768, seed=1), 32, device)
    # 16 code bytes per 32-column sub-block, 24 sub-blocks a row
    assert [gemv_subs(weight, b) for b in (8, 16, 256, 512, 4096)] == [1, 1, 16, 32, 32]
    for rows in (3, 12):
        with pytest.raises(ValueError, match="1, 2, 4 or a larger power of two"):
            grouped_int_linear(torch.randn(1, 768, device=device), weight, None, GroupedIntTiles(gemv=(rows, 512, 4, 1)))
    # 4-bit codes in blocks of 128 columns take the word GEMV and its tiles; Q4_K's 32 the byte GEMV's
    int4 = pack_grouped_int(make_quantized_weight("int4_grouped", 8, 256, seed=2), 128, device)
    with pytest.raises(ValueError, match="1, 2, 4 or a larger power of two"):
        grouped_int_linear(torch.randn(1, 256, device=device), int4, None, GroupedIntTiles(gemv4=(3, 512, 4, 1)))
    wide = INTERPRETER_GROUPED_INT_TILES.gemv
    x = torch.randn(1, 768, device=device)
    out = grouped_int_linear(x, weight, None, GroupedIntTiles(gemv=wide, gemv4=(3, 512, 4, 1)))
    assert out.shape == (1, 8)


@pytest.mark.skipif(not (torch.cuda.is_available() and pdl.AVAILABLE), reason="PDL needs an NVIDIA GPU")
def test_gemv_in_a_graph_with_pdl_matches_eager() -> None:
    """Captured with programmatic dependent launch (each GEMV reading its first tiles before it waits for
    the product before it), replays give the eager launches' bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    gemm = CudaGemmBackend("cuda")
    first = gemm.prepare_weight(
        make_quantized_weight("gguf_q4_k", 1024, 512, seed=5, device="cuda"), torch.bfloat16
    )
    second = gemm.prepare_weight(
        make_quantized_weight("gguf_q6_k", 512, 1024, seed=6, device="cuda"), torch.bfloat16
    )
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    before = pdl.enabled()
    try:
        pdl.configure(True)
        graph = torch.cuda.CUDAGraph()
        with pdl.for_capture():
            gemm.linear(gemm.linear(x, first), second)  # compile the PDL variants outside the capture
            with torch.cuda.graph(graph):
                captured = gemm.linear(gemm.linear(x, first), second)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            eager = gemm.linear(gemm.linear(x, first), second)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager)
    finally:
        pdl.configure(before)


@pytest.mark.parametrize(("capability", "fragment_rows"), [((7, 5), 0), ((8, 0), 8), ((9, 0), 8)])
def test_fragment_kernel_only_from_ampere(monkeypatch, capability: tuple[int, int], fragment_rows: int) -> None:
    """The NVIDIA backend's few-row tiles keep the fragment kernel (``mma.m16n8k16``) and the integer-dot GEMV
    (``max.NaN.f32``) off before sm_80, where those instructions do not exist; the rest of the H200 tiles stay."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # a GPU whose memory clock is not known keeps the table's integer-dot GEMV choices (test_fast_memory_tiles.py)
    monkeypatch.setattr(nvidia_gemm, "_memory_clock_and_bus", lambda index: (0, 0))
    tiles = CudaGemmBackend(torch.device("cpu"))._grouped_int_tiles()
    assert tiles.fragment_rows == fragment_rows
    assert tiles.dot_gemv_rows == (H200_GROUPED_INT_TILES.dot_gemv_rows if fragment_rows else 0)
    restored = dataclasses.replace(tiles, fragment_rows=8, dot_gemv_rows=H200_GROUPED_INT_TILES.dot_gemv_rows)
    assert restored == H200_GROUPED_INT_TILES
