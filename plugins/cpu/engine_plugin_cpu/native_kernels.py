"""Torch-facing wrappers of the C kernels (``csrc/``): checks, output tensors, threads.

Every wrapper takes and returns CPU tensors and calls one C function through ctypes (about a
microsecond a call, against several for a torch op), so a decode step costs one call per op. The
wrappers accept what the model and attention backend pass on the fast path (contiguous bf16 rows);
callers check :meth:`NativeKernels.accepts` first and keep their torch path for anything else.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from engine_plugin_cpu.amx_kernels import AmxKernels
from engine_plugin_cpu.quant_pack import gguf_blocks, nibbles

#: output rows per weight tile (one per 32-bit lane of a 512-bit register)
TILE_ROWS = 16
#: weights (out * in * rows) from which a quantized product is split over the thread pool; below it one
#: thread is faster, since the hand-off costs about as much as the work
PARALLEL_MIN_WEIGHTS = 1 << 18
#: attention work (context tokens x heads) from which decode attention is split over the pool
PARALLEL_MIN_ATTENTION = 1 << 12


@dataclass(slots=True)
class TiledWeight:
    """A GGUF 4-, 6- or 8-bit matrix regrouped into the C kernels' 16-row tile records.

    Attributes:
        bits: 4 (``w = d * q + m``, q in 0..15), 8 (``w = d * q``, q in -127..127), 6 (GGUF Q6_K:
            ``w = d * q``, q in -32..31, one ``d`` per 16 weights) or 5 (GGUF Q5_K: ``w = d * q + m``, q in
            0..31, in 8-bit records).
        records: uint8 ``[ceil(out / 16), in / 32, record bytes]`` (layout in ``csrc/quantized_linear.c``).
        out_features: rows of the logical weight (padding rows of the last tile are zero).
        in_features: columns, a multiple of 32.
    """

    bits: int
    records: torch.Tensor
    out_features: int
    in_features: int


def _tile_rows(t: torch.Tensor, out: int) -> torch.Tensor:
    """Pad dim 0 of ``t`` with zeros to whole tiles and split it: ``[tiles, 16, ...]``."""
    pad = -out % TILE_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, TILE_ROWS, *t.shape[1:])


def _fp16_lanes(values: torch.Tensor, out: int) -> torch.Tensor:
    """fp16 ``[out, blocks]`` as bytes ``[tiles, blocks, 32]``: a tile's 16 rows side by side."""
    return _tile_rows(values, out).transpose(1, 2).contiguous().view(torch.uint8)


#: GGUF K-quant type -> bytes per 256-weight super-block
K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
K_SUPER_BLOCK = 256


def k_quant_blocks(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    """View GGUF K-quant bytes as ``[out, in / 256, block_bytes]``.

    Raises:
        ValueError: if the width is not whole super-blocks or the byte count does not match.
    """
    out, width = shape
    block_bytes = K_QUANT_BYTES[type_name]
    if (
        width % K_SUPER_BLOCK
        or data.dtype != torch.uint8
        or data.numel() != out * width // K_SUPER_BLOCK * block_bytes
    ):
        raise ValueError(
            f"GGUF {type_name} data of {data.numel()} bytes does not hold a {out}x{width} matrix"
        )
    return data.reshape(out, width // K_SUPER_BLOCK, block_bytes)


def _q4_k_parts(
    data: torch.Tensor, shape: tuple[int, int], type_name: str = "Q4_K"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K (or Q5_K) as 32-weight blocks: q ``[out, blocks, 32]`` and fp16 ``d``, ``m`` with ``w = d q + m``.

    A super-block holds fp16 ``d``, ``dmin``, twelve bytes of 6-bit scales and mins for its eight
    sub-blocks, (Q5_K: 32 bytes whose bit ``i`` is the fifth bit of sub-block ``i``'s weights) and 128 bytes
    of nibbles (sub-blocks 2i and 2i + 1 share bytes 32i..32i+31, low and high nibbles);
    ``w = d * sc * q - dmin * mn``. ``d * sc`` rounds to fp16 here (2^-11 relative at most).
    """
    out = shape[0]
    blocks = k_quant_blocks(data, type_name, shape)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    raw = blocks[..., 4:16].to(torch.int32)
    low = torch.cat([raw[..., 0:4] & 63, (raw[..., 8:12] & 0x0F) | ((raw[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([raw[..., 4:8] & 63, (raw[..., 8:12] >> 4) | ((raw[..., 4:8] >> 6) << 4)], dim=-1)
    qs = blocks[..., -128:].reshape(out, -1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(out, -1, 32)
    if type_name == "Q5_K":
        qh = blocks[..., 16:48].reshape(out, -1, 1, 32)
        q = q | ((torch.cat([(qh >> i) & 1 for i in range(8)], dim=2).reshape(out, -1, 32)) << 4)
    scale = (d * low.float()).reshape(out, -1).to(torch.float16)
    zero = (-dmin * mins.float()).reshape(out, -1).to(torch.float16)
    return q, scale, zero


def tile_q4(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q4_0 / Q4_1 / Q4_K bytes as 4-bit tile records (320 bytes per tile and block).

    A Q4_0 block ``w = d * (q - 8)`` becomes ``m = -8 d`` (exact in fp16: a power-of-two multiple).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    if type_name == "Q4_K":
        q, d, m = _q4_k_parts(data, shape)
    else:
        blocks = gguf_blocks(data, type_name, shape)
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
            qs = blocks[..., 4:20]
        else:
            m = (d.float() * -8.0).to(torch.float16)
            qs = blocks[..., 2:18]
        q = nibbles(qs)  # [out, blocks, 32]
    # weight k = 8c + 4h + j -> byte (c, lane, j), nibble h
    q = _tile_rows(q, out).reshape(-1, TILE_ROWS, width // 32, 4, 2, 4)
    q = q.permute(0, 2, 3, 1, 5, 4)  # tile, block, chunk, lane, j, h
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(q.shape[0], q.shape[1], 256)
    records = torch.cat([packed, _fp16_lanes(d, out), _fp16_lanes(m, out)], dim=-1).contiguous()
    return TiledWeight(4, records, out, width)


def _byte_tiles(q: torch.Tensor, out: int, width: int) -> torch.Tensor:
    """Signed ``q`` ``[out, width]`` (int16) as unsigned bytes ``[tiles, width / 32, 512]``: chunk c of a
    block holds weights 4c..4c+3 of each of the tile's 16 rows, + 128."""
    q = (q + 128).to(torch.uint8)
    q = _tile_rows(q, out).reshape(-1, TILE_ROWS, width // 32, 8, 4)
    return q.permute(0, 2, 3, 1, 4).reshape(q.shape[0], width // 32, 512)


def tile_q6_k(data: torch.Tensor, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q6_K bytes as 6-bit tile records (576 bytes per tile and 32-weight block).

    A super-block holds 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales (one per
    16 weights) and fp16 ``d``; ``w = d * sc * (q - 32)``. ``d * sc`` rounds to fp16 here.

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    blocks = k_quant_blocks(data, "Q6_K", shape)
    ql = blocks[..., 0:128].to(torch.int16).reshape(out, -1, 2, 64)
    qh = blocks[..., 128:192].to(torch.int16).reshape(out, -1, 2, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()
    # per half of 128 weights: four runs of 32, from the low / high nibbles of ql[0:32] and ql[32:64] and
    # the four 2-bit fields of qh
    runs = [
        (ql[..., 0:32] & 0x0F) | ((qh & 3) << 4),
        (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    q = (torch.stack(runs, dim=3) - 32).reshape(out, width)
    scale = (d * sc).to(torch.float16).reshape(out, -1, 2)  # [out, blocks, half]
    records = torch.cat(
        [_byte_tiles(q, out, width), _fp16_lanes(scale[..., 0], out), _fp16_lanes(scale[..., 1], out)], dim=-1
    )
    return TiledWeight(6, records.contiguous(), out, width)


def tile_q5_k(data: torch.Tensor, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q5_K bytes as 5-bit tile records (576 bytes per tile and 32-weight block): the 8-bit records' bytes
    holding q as it is, then fp16 ``d`` and ``m`` (``d * sc`` and ``-dmin * mn`` rounded to fp16, as for Q4_K).

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    q, d, m = _q4_k_parts(data, shape, "Q5_K")
    # _byte_tiles stores q + 128: unsigned q as it is
    codes = _byte_tiles(q.to(torch.int16).reshape(out, width) - 128, out, width)
    records = torch.cat([codes, _fp16_lanes(d, out), _fp16_lanes(m, out)], dim=-1).contiguous()
    return TiledWeight(5, records, out, width)


def tile_q8(data: torch.Tensor, shape: tuple[int, int]) -> TiledWeight:
    """GGUF Q8_0 bytes as 8-bit tile records (544 bytes per tile and block), keeping every block scale.

    Raises:
        ValueError: for bytes that do not match the shape.
    """
    out, width = shape
    blocks = gguf_blocks(data, "Q8_0", shape)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    # signed q + 128 as unsigned bytes: the kernel removes 128 * sum(x) again
    q = _byte_tiles(
        blocks[..., 2:34].contiguous().view(torch.int8).to(torch.int16).reshape(out, width), out, width
    )
    records = torch.cat([q, _fp16_lanes(d, out)], dim=-1).contiguous()
    return TiledWeight(8, records, out, width)


class OmpTeam(ctypes.Structure):
    """The C kernels' ``omp_team_t``: three entry points of the OpenMP runtime torch runs its ops on."""

    _fields_ = [("parallel", ctypes.c_void_p), ("thread_num", ctypes.c_void_p), ("num_threads", ctypes.c_void_p)]


#: names of OpenMP runtimes that export GNU's ``GOMP_parallel`` (Intel's and LLVM's do, for compatibility)
OMP_LIBRARY_PREFIXES = ("libgomp", "libiomp5", "libomp")


def torch_omp_team(maps_path: str = "/proc/self/maps") -> OmpTeam | None:
    """torch's OpenMP runtime, already loaded in this process, or None (another parallel backend, no
    /proc, or several runtimes and none of them torch's own).

    Why: right after a parallel op, that runtime's workers spin on the cores for milliseconds waiting for
    the next region; a kernel run on another pool shares the cores with them, one run as a region of
    that same team starts on all of them at once.
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as fh:
            paths = {line.split()[-1] for line in fh if line.count("/") and ".so" in line}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith(OMP_LIBRARY_PREFIXES))
    torch_dir = os.path.dirname(torch.__file__)
    own = [p for p in found if p.startswith(torch_dir)]
    chosen = own[0] if own else found[0] if len(found) == 1 else None
    if chosen is None:
        return None
    try:
        lib = ctypes.CDLL(chosen, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
        entry = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError):
        return None
    return OmpTeam(*entry)


class NativeKernels(AmxKernels):
    """The loaded C library, a thread pool sized to torch's intra-op threads, and typed calls.

    Args:
        lib: the library from :func:`engine_plugin_cpu.native_build.load_native`.
        threads: pool size; None uses ``torch.get_num_threads()``.
    """

    def __init__(
        self, lib: ctypes.CDLL, threads: int | None = None, amx: bool = False, torch_threads: bool = True
    ) -> None:
        self.lib = lib
        self.threads = max(1, threads or torch.get_num_threads())
        self._pool = lib.pool_create(self.threads)
        if not self._pool:
            raise RuntimeError("the CPU kernels could not create their thread pool")
        #: the AMX tile kernels may run (the CPU has AMX-BF16 and the OS granted the tile state)
        self.amx = amx and lib.amx_request() == 0
        #: torch's OpenMP team, which the encoder attention runs on where found (else the pool)
        self.team = torch_omp_team() if torch_threads else None
        # the kernels' team argument, built once: a pointer to the team, or NULL for the pool
        self._team_arg = None if self.team is None else ctypes.byref(self.team)

    def close(self) -> None:
        if self._pool:
            self.lib.pool_destroy(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()

    @staticmethod
    def accepts(*tensors: torch.Tensor) -> bool:
        """Whether every tensor is a contiguous CPU bf16 tensor (what the kernels read)."""
        return all(
            t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
        )

    def linear(
        self, x: torch.Tensor, weight: TiledWeight, out_dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """``x @ W^T`` for contiguous bf16 ``x`` ``[..., in]``, in ``out_dtype`` (bf16 or float32).

        Raises:
            MemoryError: if the kernel cannot allocate its activation scratch.
        """
        rows = x.numel() // weight.in_features
        out = torch.empty((*x.shape[:-1], weight.out_features), dtype=out_dtype)
        work = weight.out_features * weight.in_features * rows
        threads = self.threads if work >= PARALLEL_MIN_WEIGHTS else 1
        fn = {4: self.lib.q4_linear, 8: self.lib.q8_linear, 6: self.lib.q6_linear, 5: self.lib.q5_linear}[weight.bits]
        if fn(
            self._pool, x.data_ptr(), weight.records.data_ptr(), out.data_ptr(), rows, weight.out_features,
            weight.in_features, int(out_dtype == torch.float32), threads,
        ):  # fmt: skip
            raise MemoryError("the CPU kernels could not allocate activation scratch")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        h = x.shape[-1]
        self.lib.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps)
        return out

    def add_rms_norm_f32(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual) * weight`` in bf16, ``x + residual`` in float32); ``residual`` bf16 or
        float32, contiguous like ``x``."""
        out = torch.empty_like(x)
        summed = torch.empty(x.shape, dtype=torch.float32)
        h = x.shape[-1]
        self.lib.add_rms_norm_f32(
            x.data_ptr(), residual.data_ptr(), int(residual.dtype == torch.float32), weight.data_ptr(),
            out.data_ptr(), summed.data_ptr(), x.numel() // h, h, eps,
        )  # fmt: skip
        return out, summed

    def add_layer_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        """``layer_norm(x + residual) * weight + bias`` for contiguous bf16 ``[..., h]`` (the sum rounded to
        bf16 first, statistics in float32), rows split over torch's OpenMP team where found."""
        out = torch.empty_like(x)
        rows, h = x.numel() // x.shape[-1], x.shape[-1]
        self.lib.add_layer_norm_bf16(
            self._pool, self._team_arg, x.data_ptr(), residual.data_ptr(),
            weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows, h, eps, self.threads,
        )  # fmt: skip
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
        self.lib.silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
        return out

    def rotary(self, x: torch.Tensor, heads: int, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of the first ``heads`` heads of each row of ``x`` (``[tokens, ...]``, heads
        contiguous within a row); bf16 ``[tokens, heads, head_dim]``.

        Raises:
            ValueError: for a position outside ``cos_sin``'s rows.
        """
        head_dim = cos_sin.shape[-1]
        out = torch.empty((x.shape[0], heads, head_dim), dtype=torch.bfloat16)
        if self.lib.rotary_bf16(
            x.data_ptr(), x.stride(0), out.data_ptr(), positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
            x.shape[0], heads, head_dim,
        ):  # fmt: skip
            raise ValueError(f"a position is outside the rotary table of {cos_sin.shape[0]} rows")
        return out

    def paged_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        soft_cap: float | None,
        window: int | None,
        total_context: int,
    ) -> torch.Tensor:
        """Store the new keys/values and attend one query token per sequence; bf16 ``[seqs, heads, dim]``.

        ``query`` ``[seqs, heads, dim]`` and ``key`` / ``value`` ``[seqs, kv_heads, dim]`` may be strided
        views across tokens (rows of a fused q/k/v output) but each token's heads must be contiguous.

        Raises:
            MemoryError: if the kernel cannot allocate its scratch.
        """
        seqs, heads, dim = query.shape
        kv_heads = key.shape[1]
        out = torch.empty((seqs, heads, dim), dtype=torch.bfloat16)
        threads = self.threads if total_context * heads >= PARALLEL_MIN_ATTENTION else 1
        failed = self.lib.paged_decode_bf16(
            self._pool, query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
            value.stride(0), kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2], block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), slots.data_ptr(), out.data_ptr(), seqs, heads,
            kv_heads, dim, scale, soft_cap or 0.0, window or 0, threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("the CPU decode attention could not allocate its score buffer")
        return out
