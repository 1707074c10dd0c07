"""The plugin's C kernels (``engine_plugin_cpu/csrc``) against float64 torch references, on fresh random inputs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from types import SimpleNamespace

import pytest
import torch

from engine_plugin_cpu import native_build
from engine_plugin_cpu.fast_ops import NativeOps
from engine_plugin_cpu.fast_ops import add_layer_norm as torch_add_layer_norm
from engine_plugin_cpu.gemm import BYTE_TILES, TILED4_MAX_PACKED_ROWS, CpuGemmBackend, PackedWeight
from engine_plugin_cpu.native_build import REQUIRED_CPU_FLAGS, load_native, ownership_problem
from engine_plugin_cpu.native_kernels import NativeKernels, _passive_omp_waits
from engine_plugin_cpu.platform import cpu_flags
from engine_plugin_cpu.tiled_weights import tile_iq4, tile_q4, tile_q8
from engine_plugin_sdk.quant import make_quantized_weight

#: bf16 output rounding (2^-8 relative) plus the two-level int8 activations (~2^-15 of a block's largest
#: value), relative to the output's largest entry; a wrong layout or scale is off by O(1)
LINEAR_REL_TOL = 1e-2
#: bf16 inputs and outputs of the element-wise ops: a few bf16 steps
ELEMENTWISE_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _supported() -> bool:
    return REQUIRED_CPU_FLAGS <= cpu_flags() and shutil.which("gcc") is not None


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    loaded = load_native()
    if loaded.lib is None:
        pytest.skip(f"C kernels unavailable: {loaded.reason}")
    kernels = NativeKernels(loaded.lib, threads=2)
    yield kernels
    kernels.close()


def test_native_loads_where_supported() -> None:
    loaded = load_native()
    if _supported():
        assert loaded.lib is not None, loaded.reason
    else:
        assert loaded.lib is None and loaded.reason


def test_load_native_gives_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "lacks" in load_native(flags=frozenset({"avx2"})).reason
    monkeypatch.setenv("ENGINE_CPU_NATIVE", "0")
    loaded = load_native()
    assert loaded.lib is None and "ENGINE_CPU_NATIVE" in loaded.reason


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The compiler's runs from now on (the library each would build), each giving the library this process built
    from the same sources and flags in the default cache: the cache tests below check where the kernels are built
    and loaded from, not the compiler (test_native_build_progress runs it into a fresh folder)."""
    if not _supported():
        pytest.skip("no C kernels on this machine")
    built = load_native().lib
    assert built is not None
    runs: list[str] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        out = cmd[cmd.index("-o") + 1]
        runs.append(out)
        shutil.copyfile(built._name, out)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    compiler = SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(native_build, "subprocess", compiler)
    return runs


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path, builds: list[str]
) -> None:
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", "/proc/engine-cannot-write-here")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loaded = load_native()
    assert loaded.lib is not None, loaded.reason
    assert list((tmp_path / f"engine-cpu-kernels-{os.getuid()}").glob("cpu_kernels-*.so"))
    assert len(builds) == 1


def test_ownership_problem_refuses_folders_and_files_others_can_write(tmp_path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    assert ownership_problem(folder, folder=True) == ""
    folder.chmod(0o777)
    assert "writable by other users" in ownership_problem(folder, folder=True)
    folder.chmod(0o770)
    assert "writable by other users" in ownership_problem(folder, folder=True)
    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    library.chmod(0o755)
    assert ownership_problem(library, folder=False) == ""
    assert "not a folder" in ownership_problem(library, folder=True)
    library.chmod(0o666)
    assert "writable by other users" in ownership_problem(library, folder=False)
    assert "cannot inspect" in ownership_problem(tmp_path / "missing", folder=True)


def test_a_kernel_cache_others_can_write_is_not_loaded_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path, builds: list[str]
) -> None:
    """A library planted in a world-writable cache folder is never loaded; the kernels are built in a
    private folder instead, and a cached file others could have rewritten is rebuilt."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("ENGINE_CPU_KERNEL_CACHE", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"engine-cpu-kernels-{os.getuid()}"
    assert load_native().lib is not None
    (built,) = private.glob("cpu_kernels-*.so")
    assert not list(shared.iterdir()) and len(builds) == 1 and os.path.dirname(builds[0]) == str(private)
    assert ownership_problem(private, folder=True) == ""
    # a planted file of the right name in the shared folder: loading it would fail, so success shows it was not
    (shared / built.name).write_bytes(b"not a library")
    loaded = load_native()
    assert loaded.lib is not None, loaded.reason
    # a cached library others could have rewritten is built again, not loaded (replaced, not rewritten in
    # place: this process has the old file mapped)
    planted = private / "planted"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    os.replace(planted, built)
    loaded = load_native()
    assert loaded.lib is not None, loaded.reason
    assert ownership_problem(built, folder=False) == ""
    assert len(builds) == 2  # built once, then again in place of the planted file (the shared one never)


def _tile(scheme: str, data: torch.Tensor, shape: tuple[int, int]):
    type_name = scheme[len("gguf_") :].upper()
    if type_name == "Q8_0":
        return tile_q8(data, shape)
    if type_name in BYTE_TILES:
        return BYTE_TILES[type_name](data, type_name, shape)
    if type_name.startswith("IQ4"):
        return tile_iq4(data, type_name, shape)
    return tile_q4(data, type_name, shape)


@pytest.mark.parametrize("scheme", ["gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q5_1", "gguf_iq4_nl"])
@pytest.mark.parametrize("shape", [(16, 32), (40, 96), (100, 64)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_tiled_linear_against_float64(
    native: NativeKernels, scheme: str, shape: tuple[int, int], rows: int
) -> None:
    weight = make_quantized_weight(scheme, *shape, seed=rows * 7 + shape[0])
    tiled = _tile(scheme, weight.data, shape)
    gen = torch.Generator().manual_seed(rows + shape[1])
    x = (torch.randn(rows, shape[1], generator=gen) * torch.rand(1, shape[1], generator=gen) * 4).to(
        torch.bfloat16
    )
    expected = x.double() @ weight.dequantize().double().T
    got = native.linear(x, tiled)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
    err = (got.double() - expected).abs().max().item()
    assert err <= LINEAR_REL_TOL * expected.abs().max().item(), f"{scheme} {shape} rows={rows}: error {err}"


@pytest.mark.parametrize("scheme", ["gguf_q2_k", "gguf_q3_k", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k", "gguf_iq4_xs"])
@pytest.mark.parametrize("shape", [(16, 256), (40, 512)])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_k_quant_tiles_against_float64(native: NativeKernels, scheme: str, shape: tuple[int, int], rows: int) -> None:
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS decoded by the plugin (scales rounded to fp16) against gguf's own dequantisation."""
    weight = make_quantized_weight(scheme, *shape, seed=rows + shape[0])
    tiled = _tile(scheme, weight.data, shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    expected = x.double() @ weight.dequantize().double().T
    got = native.linear(x, tiled, torch.float32)
    err = (got.double() - expected).abs().max().item()
    # float32 output: what is left is the activation levels and the fp16 sub-block scales (2^-11)
    assert err <= 2e-3 * expected.abs().max().item(), f"{scheme} {shape} rows={rows}: error {err}"


def test_k_quants_stay_quantized_only_with_the_c_kernels(native: NativeKernels) -> None:
    weight = make_quantized_weight("gguf_q4_k", 32, 256, seed=2)
    with_native = CpuGemmBackend(native=native)
    assert "gguf_q4_k" in with_native.supported_quant_schemes
    prepared = with_native.prepare_weight(weight, torch.bfloat16)
    assert prepared.kind == "tiled" and prepared.tiled.bits == 4
    torch_only = CpuGemmBackend()
    assert "gguf_q4_k" not in torch_only.supported_quant_schemes
    dense = torch_only.prepare_weight(weight, torch.bfloat16)
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16
    # read back through the product: a bf16 weight may be kept in oneDNN's opaque blocked layout
    rows = torch_only.linear(torch.eye(256, dtype=torch.bfloat16), dense).t()
    torch.testing.assert_close(rows.float(), weight.dequantize(), atol=0, rtol=2**-8)


def test_tiled_linear_is_the_same_on_one_and_two_threads(native: NativeKernels) -> None:
    weight = make_quantized_weight("gguf_q4_1", 1000, 576, seed=3)
    tiled = tile_q4(weight.data, "Q4_1", (1000, 576))
    x = torch.randn(3, 576).to(torch.bfloat16)
    single = NativeKernels(native.lib, threads=1)
    try:
        assert torch.equal(single.linear(x, tiled), native.linear(x, tiled))
    finally:
        single.close()


def test_gemm_backend_routes_small_batches_to_the_c_kernels(native: NativeKernels) -> None:
    weight = make_quantized_weight("gguf_q4_1", 48, 128, seed=11)
    gemm = CpuGemmBackend(native=native)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    assert isinstance(prepared, PackedWeight) and prepared.kind == "tiled" and prepared.dense is not None
    bias = torch.randn(48).to(torch.bfloat16)
    for rows in (1, TILED4_MAX_PACKED_ROWS, TILED4_MAX_PACKED_ROWS + 1):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        expected = x.double() @ weight.dequantize().double().T + bias.double()
        got = gemm.linear(x.reshape(1, rows, 128), prepared, bias)
        assert got.shape == (1, rows, 48)
        err = (got.double().reshape(rows, 48) - expected).abs().max().item()
        assert err <= LINEAR_REL_TOL * expected.abs().max().item()


def test_logits_are_written_in_float32(native: NativeKernels) -> None:
    weight = make_quantized_weight("gguf_q8_0", 4000, 128, seed=13)
    gemm = CpuGemmBackend(native=native)
    prepared = gemm.prepare_weight(weight, torch.bfloat16)
    x = torch.randn(3, 128).to(torch.bfloat16)
    expected = x.double() @ weight.dequantize().double().T
    got = gemm.logits(x, prepared)
    assert got.dtype == torch.float32
    # bf16 logits would be off by up to 2^-9 of each value; float32 ones only by the activation levels
    rel = ((got.double() - expected).abs() / expected.abs().clamp_min(1.0)).max().item()
    assert rel < 5e-4, rel


def _ops(native: NativeKernels) -> NativeOps:
    return NativeOps(native)


def test_rms_norms_against_float64(native: NativeKernels) -> None:
    ops = _ops(native)
    x = torch.randn(5, 200).to(torch.bfloat16)
    residual = torch.randn(5, 200).to(torch.bfloat16)
    weight = torch.randn(200).to(torch.bfloat16)

    def ref(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()

    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5).double(), ref(x), **ELEMENTWISE_TOL)
    out, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    # the residual stream is kept in float32: the sum is exact there, not rounded to bf16
    assert summed.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(summed, x.float() + residual.float())
    torch.testing.assert_close(out.double(), ref(summed), **ELEMENTWISE_TOL)
    # ... and comes back as the next layer's residual
    out2, summed2 = ops.fused_add_rms_norm(x, summed, weight, 1e-5)
    assert torch.equal(summed2, x.float() + summed)
    torch.testing.assert_close(out2.double(), ref(summed2), **ELEMENTWISE_TOL)
    # a strided activation falls back to torch and still returns bf16 activations
    out3, _ = ops.fused_add_rms_norm(torch.randn(5, 400).to(torch.bfloat16)[:, ::2], summed, weight, 1e-5)
    assert out3.dtype == torch.bfloat16
    # a strided input takes the torch path and agrees
    strided = torch.randn(5, 400).to(torch.bfloat16)[:, ::2]
    torch.testing.assert_close(ops.rms_norm(strided, weight, 1e-5).double(), ref(strided), **ELEMENTWISE_TOL)


@pytest.mark.parametrize(("rows", "h"), [(3, 100), (300, 384)])  # one thread; rows split, a tail vector
def test_add_layer_norm_against_float64(native: NativeKernels, rows: int, h: int) -> None:
    ops = _ops(native)
    x, residual = (torch.randn(rows, h).to(torch.bfloat16) for _ in range(2))
    weight, bias = torch.randn(h).to(torch.bfloat16), torch.randn(h).to(torch.bfloat16)
    # the reference normalises the sum rounded to bf16, as the unfused add would give it
    summed = (x + residual).double()
    normed = (summed - summed.mean(-1, keepdim=True)) * torch.rsqrt(summed.var(-1, unbiased=False, keepdim=True) + 1e-12)
    for b in (bias, None):
        expected = normed * weight.double() + (0.0 if b is None else b.double())
        got = ops.add_layer_norm(x, residual, weight, b, 1e-12)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, **ELEMENTWISE_TOL)
    # a strided input takes torch's path and agrees
    strided = torch.randn(rows, 2 * h).to(torch.bfloat16)[:, ::2]
    torch.testing.assert_close(
        ops.add_layer_norm(strided, residual, weight, bias, 1e-12).double(),
        torch_add_layer_norm(strided, residual, weight, bias, 1e-12).double(), **ELEMENTWISE_TOL,
    )  # fmt: skip


def test_silu_and_mul_against_float64(native: NativeKernels) -> None:
    x = (torch.randn(3, 2 * 72) * 6).to(torch.bfloat16)
    gate, up = x.double()[:, :72], x.double()[:, 72:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(_ops(native).silu_and_mul(x).double(), expected, **ELEMENTWISE_TOL)


@pytest.mark.parametrize("tokens", [1, 4])
def test_rotary_against_float64(native: NativeKernels, tokens: int) -> None:
    heads, kv_heads, dim = 3, 1, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    cos_sin = torch.randn(50, dim)
    positions = torch.randint(0, 50, (tokens,))
    before = qkv.clone()
    got_q, got_k = _ops(native).rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(qkv, before), "the inputs must not be modified"

    def ref(x: torch.Tensor) -> torch.Tensor:
        cs = cos_sin[positions].double()[:, None]
        cos, sin = cs[..., : dim // 2], cs[..., dim // 2 :]
        x1, x2 = x.double()[..., : dim // 2], x.double()[..., dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    torch.testing.assert_close(got_q.double(), ref(q), **ELEMENTWISE_TOL)
    torch.testing.assert_close(got_k.double(), ref(k), **ELEMENTWISE_TOL)
    for bad in (50, -1):  # the kernel checks every position against the table before reading it
        with pytest.raises(ValueError, match="rotary table"):
            _ops(native).rotary_embedding(torch.full((tokens,), bad), q, k, cos_sin)


def _reference_decode(q, cache, tables, lens, scale, window, cap):
    seqs, heads, dim = q.shape
    kv_heads = cache.shape[3]
    block = cache.shape[2]
    out = torch.zeros(seqs, heads, dim, dtype=torch.float64)
    for s in range(seqs):
        n = int(lens[s])
        start = max(0, n - window) if window else 0
        pos = torch.arange(start, n)
        ids = tables[s][pos // block].long() * block + pos % block
        keys = cache[0].reshape(-1, kv_heads, dim)[ids].double()
        vals = cache[1].reshape(-1, kv_heads, dim)[ids].double()
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[:, g] @ q[s, h].double() * scale
            if cap:
                scores = cap * torch.tanh(scores / cap)
            if n > start:
                out[s, h] = torch.softmax(scores, 0) @ vals[:, g]
    return out


@pytest.mark.parametrize(
    ("dim", "block", "window", "cap"), [(64, 16, None, None), (128, 8, None, 30.0), (64, 32, 20, None)]
)
def test_paged_decode_against_float64(native: NativeKernels, dim: int, block: int, window, cap) -> None:
    heads, kv_heads, num_blocks = 6, 2, 40
    lens = torch.tensor([1, 37, 70, 5], dtype=torch.int32)
    seqs = lens.numel()
    width = 70 // block + 1
    perm = torch.randperm(num_blocks)
    tables = perm[: seqs * width].reshape(seqs, width).to(torch.int32)
    cache = torch.randn(2, num_blocks, block, kv_heads, dim).to(torch.bfloat16)
    qkv = torch.randn(seqs, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    q = qkv[:, : heads * dim].reshape(seqs, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(seqs, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(seqs, kv_heads, dim)
    last = (lens - 1).long()
    slots = (tables[torch.arange(seqs), last // block].long() * block + last % block).to(torch.int64)
    slots[2] = -1  # a padding row: its key and value are stored nowhere
    untouched = cache.clone()
    got = native.paged_decode(q, k, v, cache, tables, lens, slots, dim**-0.5, cap, window, int(lens.sum()))
    flat_k, flat_v = cache[0].reshape(-1, kv_heads, dim), cache[1].reshape(-1, kv_heads, dim)
    for s in (0, 1, 3):
        assert torch.equal(flat_k[slots[s]], k[s]) and torch.equal(flat_v[slots[s]], v[s])
    changed = (cache != untouched).reshape(2, -1, kv_heads * dim).any(-1).any(0).nonzero().flatten()
    assert set(changed.tolist()) <= {int(slots[s]) for s in (0, 1, 3)}
    expected = _reference_decode(q, cache, tables, lens, dim**-0.5, window, cap)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


def test_products_on_torchs_team_give_the_pools_bits(native: NativeKernels) -> None:
    """The quantized products on torch's OpenMP team (the default unless its workers wait passively) against the
    pool's own threads: 1 to 5 rows of 4- and 8-bit tiles, split over two threads, the same bits; and a forked
    child of a process that ran them on the team takes the pool's serial path instead of waiting for the
    parent's OpenMP workers."""
    if native.team is None:
        pytest.skip("torch's OpenMP runtime was not found")
    on_team = NativeKernels(native.lib, threads=2, linear_on_team=True)
    on_pool = NativeKernels(native.lib, threads=2, linear_on_team=False)
    q4 = tile_q4(make_quantized_weight("gguf_q4_1", 2000, 256, seed=5).data, "Q4_1", (2000, 256))
    q8 = tile_q8(make_quantized_weight("gguf_q8_0", 1000, 512, seed=6).data, (1000, 512))
    gen = torch.Generator().manual_seed(7)
    for tiled in (q4, q8):
        for rows in (1, 2, 3, 5):
            x = torch.randn(rows, tiled.in_features, generator=gen).to(torch.bfloat16)
            assert torch.equal(on_team.linear(x, tiled), on_pool.linear(x, tiled)), rows
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    expected = on_team.linear(x, q4)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if torch.equal(on_team.linear(x, q4), expected) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the OpenMP team")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    on_team.close()
    on_pool.close()


def test_passive_openmp_waits_keep_the_products_on_the_pool() -> None:
    assert _passive_omp_waits({"OMP_WAIT_POLICY": "PASSIVE"})
    assert not _passive_omp_waits({}) and not _passive_omp_waits({"OMP_WAIT_POLICY": "active"})


def test_a_forked_child_runs_the_kernels_without_the_parents_workers(native: NativeKernels) -> None:
    weight = make_quantized_weight("gguf_q4_1", 2000, 256, seed=4)
    tiled = tile_q4(weight.data, "Q4_1", (2000, 256))
    x = torch.randn(2, 256).to(torch.bfloat16)
    expected = native.linear(x, tiled)  # the parent's workers are up and running
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pool has no worker threads; it must not wait for them
        try:
            os.write(write_fd, native.linear(x, tiled).view(torch.int16).numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the C kernels")
        time.sleep(0.05)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    got = torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).reshape(2, 2000)
    assert torch.equal(got, expected)
