"""Torch-facing wrappers of the C kernels (``csrc/``): checks, output tensors, threads.

Every wrapper takes and returns CPU tensors and calls one C function through ctypes (about a
microsecond a call, against several for a torch op), so a decode step costs one call per op. The
wrappers accept what the model and attention backend pass on the fast path (contiguous bf16 rows);
callers check :meth:`NativeKernels.accepts` first and keep their torch path for anything else.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import torch

from engine_plugin_cpu.amx_kernels import AmxKernels
from engine_plugin_cpu.tiled_weights import TiledWeight

#: weights (out * in * rows) from which a quantized product is split over the thread pool; below it one
#: thread is faster, since the hand-off costs about as much as the work
PARALLEL_MIN_WEIGHTS = 1 << 18
#: attention work (context tokens x heads) from which decode attention is split over the pool
PARALLEL_MIN_ATTENTION = 1 << 12


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


def _passive_omp_waits(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the OpenMP runtime's workers sleep between parallel regions (``OMP_WAIT_POLICY=passive``)."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


class NativeKernels(AmxKernels):
    """The loaded C library, a thread pool sized to torch's intra-op threads, and typed calls.

    Args:
        lib: the library from :func:`engine_plugin_cpu.native_build.load_native`.
        threads: pool size; None uses ``torch.get_num_threads()``.
        linear_on_team: whether the quantized products and decode attention run on torch's OpenMP team where
            found; None: unless its workers wait passively (``OMP_WAIT_POLICY=passive``).
    """

    def __init__(
        self, lib: ctypes.CDLL, threads: int | None = None, amx: bool = False, torch_threads: bool = True,
        linear_on_team: bool | None = None,
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
        # the quantized products and decode attention run on torch's team too unless its workers sleep between
        # regions (then all on the pool, whose workers spin about 200 us between tasks): two sets of
        # spinning workers on the same cores stall each other (the embedded model's decode on 2 cores: 1 / 2 / 4
        # sequences 100 / 133 / 234 tok/s on the pool, 119 / 187 / 296 on the team), while a passive team's
        # workers wake by futex for every product (49 / 88 / 160 against the pool's 100 / 164 / 268)
        on_team = not _passive_omp_waits() if linear_on_team is None else linear_on_team
        self._step_team = self._team_arg if on_team else None

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
        fn = {
            4: self.lib.iq4_linear if weight.iq4 else self.lib.q4_linear, 8: self.lib.q8_linear,
            6: self.lib.q6_linear, 5: self.lib.q5_linear, 2: self.lib.q2_linear,
        }[weight.bits]  # fmt: skip
        if fn(
            self._pool, self._step_team, x.data_ptr(), weight.records.data_ptr(), out.data_ptr(), rows,
            weight.out_features, weight.in_features, int(out_dtype == torch.float32), threads,
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
            self._pool, self._step_team, query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0),
            key.stride(0),
            value.stride(0), kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2], block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), slots.data_ptr(), out.data_ptr(), seqs, heads,
            kv_heads, dim, scale, soft_cap or 0.0, window or 0, threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("the CPU decode attention could not allocate its score buffer")
        return out
