"""GEMM on the CPU: dense weights through ``F.linear``, GGUF Q4_0/Q4_1/Q8_0 through packed kernels.

Grouped-int weights (``int4_grouped`` / ``int8_grouped``: GPTQ, AWQ, compressed-tensors) run on the same
kernels where they repack exactly into those GGUF blocks (``grouped_int.repack_grouped_as_gguf``: no
act-order, groups a multiple of 32, fp16-exact scales, symmetric int8); others are dequantised at load.

Small batches (decode) are bound by reading the weights, so they run on the packed weights (4.5 / 8.5
bits a weight instead of 16): the plugin's own VNNI kernels (``native_kernels``, every GGUF block scale
kept) where the CPU and a C compiler allow, else torch's int4 / int8 kernels. Large batches are bound by arithmetic, where torch's bf16 GEMM
beats its weight-only kernels on CPUs without AMX, so a packed weight also keeps a bf16 copy and rows
above a per-kind threshold go to it (``ENGINE_CPU_DENSE_COPY=0`` drops the copies to save memory).
The copy is prepacked in oneDNN's blocked layout where torch has oneDNN (bit-identical to ``F.linear``;
measured on a 2-core AMX Xeon: 1.5-2x faster at 1-32 rows, 1.1-1.6x at 8,192 rows of an encoder's batch,
where ``F.linear`` also spends a pass broadcasting the bias), and so is every plain bf16 weight, unless the
C kernels have AMX tiles: it is then packed as tiles (``amx_kernels.AmxWeight``) for the plugin's own
product, whose epilogue applies the bias and GELU while the tile unit computes (the up projection of an
encoder with GELU 1.4x oneDNN's post-op; a bf16 decoder's steps 1.1-1.25x). Small batches run on one
thread: the packed kernels gain
nothing from a second thread at 1-4 rows, and waking it costs more than it saves.
Packed kernels need bf16 activations; in a float32 model a quantized weight is dequantised exactly,
so that the float32 path stays bit-for-bit what a dequantised checkpoint gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from engine_plugin_cpu.amx_kernels import AmxWeight, amx_packable, pack_amx_weight
from engine_plugin_cpu.grouped_int import SYMMETRIC_ZERO, repack_grouped_as_gguf
from engine_plugin_cpu.moe import fused_moe_few_tokens
from engine_plugin_cpu.native_kernels import NativeKernels
from engine_plugin_cpu.quant_pack import (
    GGUF_BLOCK,
    codes_as_q8_0,
    pack_int4,
    requantize_int8_rows,
    unpack_q4,
    unpack_q8_0,
)
from engine_plugin_cpu.tiled_weights import TiledWeight, tile_iq4, tile_q2, tile_q4, tile_q5, tile_q6, tile_q8
from engine_plugin_sdk import (
    ExpertWeights,
    GemmBackend,
    QuantizedWeight,
    gelu_tanh_and_mul,
    grouped_add_lora,
    silu_and_mul,
    torch_dtype,
)

#: scheme name -> GGUF type name, for the schemes kept quantized
PACKED_SCHEMES = {"gguf_q4_0": "Q4_0", "gguf_q4_1": "Q4_1", "gguf_q8_0": "Q8_0"}
#: K-quants kept quantized by the C kernels only (torch's kernels cannot express their scales)
NATIVE_ONLY_SCHEMES = {
    "gguf_q4_k": "Q4_K", "gguf_q5_k": "Q5_K", "gguf_q6_k": "Q6_K", "gguf_q5_1": "Q5_1", "gguf_q3_k": "Q3_K",
    "gguf_q2_k": "Q2_K", "gguf_iq4_nl": "IQ4_NL", "gguf_iq4_xs": "IQ4_XS",
}  # fmt: skip
#: the GGUF types whose tile records hold a byte a weight, by their builder
BYTE_TILES = {"Q6_K": tile_q6, "Q3_K": tile_q6, "Q5_K": tile_q5, "Q5_1": tile_q5, "Q2_K": tile_q2}
#: GGUF schemes repacked into Q8_0's bytes at load (``codes_as_q8_0``): Q5_0's 5-bit values and IQ4_NL's table
#: values exactly, IQ4_XS's with its group scales rounded to fp16 (as the K-quants' tiles round);
#: the IQ4 types only without the C kernels, which read their nibbles as they are
REPACKED_SCHEMES = frozenset({"gguf_q5_0", "gguf_iq4_nl", "gguf_iq4_xs"})
#: grouped-int schemes: repacked into the GGUF schemes above where exact, else dequantised at load
GROUPED_SCHEMES = frozenset(SYMMETRIC_ZERO)
#: the activation dtype the packed kernels run in
PACKED_DTYPE = torch.bfloat16
#: most rows run on the packed weight (more go to the dense copy); measured crossovers on a 2-core
#: AVX-512-bf16 EPYC with SmolLM2-135M shapes: int4 beats bf16 up to ~12 rows, int8 only up to ~2
INT4_MAX_PACKED_ROWS = 12
INT8_MAX_PACKED_ROWS = 2
#: set to 0 to keep no bf16 copy of packed weights (every batch size then runs on the packed kernels)
DENSE_COPY_ENV = "ENGINE_CPU_DENSE_COPY"
#: most activation rows a packed kernel runs on one thread; measured on 2 cores at batch 1: 46 tok/s
#: with 2 threads, 51 with 1 (the int4 and int8 kernels do not speed up with a second thread there)
SINGLE_THREAD_MAX_ROWS = 4
#: ... unless the weight is large: the tied 49152x576 int8 lm_head takes 3.3 ms on one thread and 1.6 ms
#: on two; the layer matrices (up to 3072x576) are as fast or faster on one
SINGLE_THREAD_MAX_ELEMENTS = 8 * 2**20
#: multiply-adds of a step's LoRA products below which they run on one thread (a decode step's are tens
#: of microseconds; a barrier of torch's pool on a busy 2-core machine can cost milliseconds)
LORA_SINGLE_THREAD_MAX_WORK = 64 * 2**20
#: most rows the C kernels run before the bf16 dense copy takes over: measured time ratios (C / oneDNN,
#: both on 2 threads, SmolLM2 shapes) at 24 / 32 / 48 rows: 4-bit 0.68-1.03 / 0.84-1.06 / 0.83-1.03,
#: 8-bit lm_head 0.83 / 1.04 / 1.02
TILED4_MAX_PACKED_ROWS = 32
TILED8_MAX_PACKED_ROWS = 24
#: largest bf16 weight kept in oneDNN's blocked layout (:func:`prepack_dense`); a larger one (a big
#: vocabulary's tied LM head) stays plain, since the reorder is a copy and the embedding keeps the original
PREPACK_MAX_ELEMENTS = 64 * 2**20
#: most rows whose logits the C kernels write in float32 (about as fast as the bf16 copy up to here)
TILED_MAX_LOGIT_ROWS = 64


@dataclass(slots=True)
class PackedWeight:
    """A weight prepared for one of torch's weight-only quantized CPU kernels.

    Attributes:
        kind: ``"tiled"`` (the plugin's C kernels, weight in ``tiled``), ``"int4"``
            (``_weight_int4pack_mm_for_cpu``, group 32) or ``"int8"`` (``_weight_int8pack_mm``).
        packed: torch's kernel's weight tensor (None for ``"tiled"``).
        scales: int4: scales and zeros ``[in/32, out, 2]``; int8: per-row scales ``[out]``; in bf16;
            None for ``"tiled"``.
        out_features: rows of the logical weight.
        in_features: columns of the logical weight.
        dense: a bf16 ``[out, in]`` copy for batches above ``max_packed_rows`` (AMX tiles or an
            oneDNN-prepacked tensor where available, see ``CpuGemmBackend._dense_layout``), or None.
        max_packed_rows: most activation rows sent to the packed kernel when ``dense`` exists.
        tiled: the C kernels' weight, for ``"tiled"``.
    """

    kind: str
    packed: torch.Tensor | None
    scales: torch.Tensor | None
    out_features: int
    in_features: int
    dense: torch.Tensor | AmxWeight | None
    max_packed_rows: int
    tiled: TiledWeight | None = None


class CpuGemmBackend(GemmBackend):
    """``F.linear`` for dense weights; packed int4 / int8 kernels for GGUF Q4_0, Q4_1 and Q8_0 in bf16.

    Grouped-int weights are repacked into those GGUF types where that is exact (see
    :mod:`engine_plugin_cpu.grouped_int`), else dequantised like any other scheme.

    Args:
        dense_copy: keep a bf16 copy of each packed weight for large batches; None reads
            ``ENGINE_CPU_DENSE_COPY`` (default on).
        prepack: reorder those copies for oneDNN (:func:`prepack_dense`); off for compiled steps,
            since ``torch.compile`` cannot trace oneDNN's opaque tensors.
        native: the plugin's C kernels, or None to use torch's packed kernels.
    """

    gated_activations: frozenset[str] = frozenset({"silu", "gelu_tanh"})
    fused_activations: frozenset[str] = frozenset({"gelu"})
    #: the torch path's schemes; an instance with the C kernels adds the K-quants (see ``__init__``)
    supported_quant_schemes: frozenset[str] = frozenset(PACKED_SCHEMES) | frozenset(REPACKED_SCHEMES) | GROUPED_SCHEMES

    def __init__(
        self, dense_copy: bool | None = None, prepack: bool = True, native: NativeKernels | None = None
    ) -> None:
        if dense_copy is None:
            dense_copy = os.environ.get(DENSE_COPY_ENV, "1").strip() not in ("0", "false", "no", "off")
        self.dense_copy = dense_copy
        self.prepack = prepack
        self.native = native
        schemes = PACKED_SCHEMES if native is None else {**PACKED_SCHEMES, **NATIVE_ONLY_SCHEMES}
        self.type_names = schemes
        self.supported_quant_schemes = frozenset(schemes) | frozenset(REPACKED_SCHEMES) | GROUPED_SCHEMES

    def prepare_weight(self, weight: Any, dtype: Any, dense_copy: bool | None = None) -> torch.Tensor | PackedWeight:
        """:meth:`GemmBackend.prepare_weight`; ``dense_copy`` overrides the instance's choice of a bf16 copy
        beside a packed weight."""
        target = torch_dtype(dtype)
        copy = self.dense_copy if dense_copy is None else dense_copy
        if isinstance(weight, QuantizedWeight):
            if weight.scheme in GROUPED_SCHEMES and target == PACKED_DTYPE:
                repacked = repack_grouped_as_gguf(weight)
                # None where the GGUF blocks cannot hold it exactly: it then takes the dequantising path
                if repacked is not None:
                    weight = repacked
            if weight.scheme in REPACKED_SCHEMES and weight.scheme not in self.type_names and target == PACKED_DTYPE:
                weight = _repacked_gguf(weight)
            if weight.scheme in self.type_names and target == PACKED_DTYPE:
                return self._pack(weight, copy)
            weight = _dequantize(weight)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"cannot prepare a weight of type {type(weight).__name__}; expected a tensor")
        if not weight.is_floating_point():
            raise ValueError(
                f"cannot prepare an unquantized weight of dtype {weight.dtype}; expected floating point"
            )
        # contiguous so that every linear() hits the fast BLAS layout without a hidden copy
        weight = weight.to(device="cpu", dtype=target).contiguous()
        if weight.dtype == torch.bfloat16 and weight.numel() <= PREPACK_MAX_ELEMENTS:
            return self._dense_layout(weight)
        return weight

    def _dense_layout(self, weight: torch.Tensor) -> torch.Tensor | AmxWeight:
        """A bf16 weight (or a packed weight's bf16 copy) in the layout its products read fastest: the AMX
        kernels' tiles where granted, else oneDNN's blocked layout (without ``prepack``: as it is)."""
        if not self.prepack:
            return weight
        if self.native is not None and self.native.amx and amx_packable(weight):
            return pack_amx_weight(weight)
        return prepack_dense(weight)

    def prepare_experts(
        self, gate_up: list[Any], down: list[Any], dtype: Any, gate_up_bias: list[Any] | None = None,
        down_bias: list[Any] | None = None,
    ) -> ExpertWeights:  # fmt: skip
        """Each expert packed as a layer's weight is, but without the bf16 copy for long prompts: a layer's
        copies would take several times its packed experts, each of which sees a fraction of the rows."""
        return ExpertWeights(
            [self.prepare_weight(w, dtype, dense_copy=False) for w in gate_up],
            [self.prepare_weight(w, dtype, dense_copy=False) for w in down], gate_up_bias, down_bias,
        )  # fmt: skip

    def fused_moe(self, x: Any, experts: Any, topk_weights: Any, topk_ids: Any, activation: str = "silu") -> Any:
        native = self.native
        gated = native.silu_and_mul if native is not None and native.accepts(x) else None
        return fused_moe_few_tokens(self, x, experts, topk_weights, topk_ids, activation, gated)

    def _pack(self, weight: QuantizedWeight, copy: bool) -> PackedWeight:
        type_name = self.type_names[weight.scheme]
        out, width = (int(d) for d in weight.shape)
        data = weight.data.to("cpu")
        if self.native is not None:
            return self._tile(weight, data, type_name, out, width, copy)
        if type_name == "Q8_0":
            dense32 = unpack_q8_0(data, (out, width))
            packed, scales = requantize_int8_rows(dense32, PACKED_DTYPE)
            kind, max_rows = "int8", INT8_MAX_PACKED_ROWS
        else:
            blocks = unpack_q4(data, type_name, (out, width))
            packed, scales = pack_int4(blocks, PACKED_DTYPE)
            dense32 = blocks.dense() if copy else None
            kind, max_rows = "int4", INT4_MAX_PACKED_ROWS
        dense = None
        if copy and dense32 is not None:
            dense = dense32.to(PACKED_DTYPE).contiguous()
            dense = self._dense_layout(dense)
        return PackedWeight(kind, packed, scales, out, width, dense, max_rows)

    def _tile(
        self, weight: QuantizedWeight, data: torch.Tensor, type_name: str, out: int, width: int, copy: bool
    ) -> PackedWeight:
        if type_name == "Q8_0":
            tiled, max_rows = tile_q8(data, (out, width)), TILED8_MAX_PACKED_ROWS
            dense32 = unpack_q8_0(data, (out, width)) if copy else None
        elif type_name in BYTE_TILES:
            tile = BYTE_TILES[type_name]
            tiled, max_rows = tile(data, type_name, (out, width)), TILED8_MAX_PACKED_ROWS
            dense32 = _dequantize(weight) if copy else None
        elif type_name in ("IQ4_NL", "IQ4_XS"):
            tiled, max_rows = tile_iq4(data, type_name, (out, width)), TILED4_MAX_PACKED_ROWS
            dense32 = _dequantize(weight) if copy else None
        else:
            tiled, max_rows = tile_q4(data, type_name, (out, width)), TILED4_MAX_PACKED_ROWS
            dense32 = None
            if copy:
                dense32 = (
                    _dequantize(weight)
                    if type_name == "Q4_K"
                    else unpack_q4(data, type_name, (out, width)).dense()
                )
        dense = None
        if dense32 is not None:
            dense = dense32.to(PACKED_DTYPE).contiguous()
            dense = self._dense_layout(dense)
        return PackedWeight("tiled", None, None, out, width, dense, max_rows, tiled)

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> torch.Tensor:
        if isinstance(weight, AmxWeight):
            return self._amx(x, weight, bias, "none")
        if not isinstance(weight, PackedWeight):
            return dense_linear(x, weight, bias)
        rows = x.numel() // weight.in_features
        if weight.dense is not None and rows > weight.max_packed_rows:
            return self.linear(x, weight.dense, bias)
        if x.dtype != PACKED_DTYPE:
            raise ValueError(f"packed weights run with {PACKED_DTYPE} activations, got {x.dtype}")
        if weight.tiled is not None and self.native is not None:
            out = self.native.linear(x.contiguous(), weight.tiled)
            return out + bias if bias is not None else out
        # a compiled step sets the thread count around the whole step instead (graph_capture.py)
        if torch.compiler.is_compiling():
            return self._packed_linear(x, weight, bias, rows)
        threads = torch.get_num_threads()
        large = weight.out_features * weight.in_features > SINGLE_THREAD_MAX_ELEMENTS
        if rows > SINGLE_THREAD_MAX_ROWS or threads == 1 or large:
            return self._packed_linear(x, weight, bias, rows)
        torch.set_num_threads(1)
        try:
            return self._packed_linear(x, weight, bias, rows)
        finally:
            torch.set_num_threads(threads)

    def gated_linear(self, x: Any, weight: Any, activation: str) -> torch.Tensor:
        """The product, then the activation (the C kernel's SwiGLU on bf16 rows): nothing fuses on a CPU,
        where the product's output stays in cache for the activation anyway."""
        if activation not in self.gated_activations:
            return super().gated_linear(x, weight, activation)
        projected = self.linear(x, weight)
        if activation == "gelu_tanh":
            return gelu_tanh_and_mul(projected)
        if self.native is not None and self.native.accepts(projected) and projected.shape[-1] % 2 == 0:
            return self.native.silu_and_mul(projected)
        return silu_and_mul(projected)

    def linear_activation(self, x: Any, weight: Any, bias: Any | None, activation: str) -> torch.Tensor:
        """GELU as a post-op of oneDNN's product on a prepacked bf16 weight, applied to the float32
        accumulator (bge-small's up projection, 8,192 rows: 5.7 ms against 8.0 for the product, then
        torch's GELU reading it back); other weights: the product, then torch's GELU."""
        if activation not in self.fused_activations:
            return super().linear_activation(x, weight, bias, activation)
        if isinstance(weight, AmxWeight):
            return self._amx(x, weight, bias, "gelu")
        if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "none")
        return torch.nn.functional.gelu(self.linear(x, weight, bias))

    def add_lora(self, y: Any, x: Any, weights: Any, plan: Any) -> None:
        """The SDK's grouped products, on one thread when small: a step's adapters add a few tiny products
        per projection, between the C kernels whose pool would contend with torch's for the cores."""
        if plan is None:
            return
        threads = torch.get_num_threads()
        work = plan.rows.numel() * weights.rank * (weights.a.shape[2] + weights.b.shape[1])
        if threads == 1 or work > LORA_SINGLE_THREAD_MAX_WORK:
            grouped_add_lora(y, x, weights, plan)
            return
        torch.set_num_threads(1)
        try:
            grouped_add_lora(y, x, weights, plan)
        finally:
            torch.set_num_threads(threads)

    def logits(self, x: Any, weight: Any) -> torch.Tensor:
        """float32 logits; written in float32 by the C kernels, so near-tied tokens keep their order."""
        if (
            isinstance(weight, PackedWeight)
            and weight.tiled is not None
            and self.native is not None
            and x.dtype == PACKED_DTYPE
            and x.numel() // weight.in_features <= TILED_MAX_LOGIT_ROWS
        ):
            return self.native.linear(x.contiguous(), weight.tiled, torch.float32)
        return self.linear(x, weight).float()

    def _amx(self, x: torch.Tensor, weight: AmxWeight, bias: Any | None, activation: str) -> torch.Tensor:
        assert self.native is not None  # only an instance with the AMX kernels packs AmxWeights
        if x.dtype != torch.bfloat16:
            raise ValueError(f"AMX-packed bf16 weights run with bf16 activations, got {x.dtype}")
        return self.native.dense(x if x.stride(-1) == 1 else x.contiguous(), weight, bias, activation)

    @staticmethod
    def _packed_linear(x: torch.Tensor, weight: PackedWeight, bias: Any | None, rows: int) -> torch.Tensor:
        # the kernels take 2-D contiguous activations only
        flat = x.reshape(rows, weight.in_features).contiguous()
        if weight.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight.packed, GGUF_BLOCK, weight.scales)
            if out.shape[-1] != weight.out_features:  # rows padded for the kernel
                out = out[:, : weight.out_features]
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, weight.packed, weight.scales)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.out_features)


def prepack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous bf16 ``[out, in]`` weight, reordered into oneDNN's blocked layout when torch has oneDNN.

    The reorder is chosen for 32-row batches but serves any row count; results are bit-identical to
    ``F.linear`` on the plain weight.
    """
    weight = weight.contiguous()
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any | None) -> torch.Tensor:
    """``F.linear`` on a plain or :func:`prepack_dense`-reordered weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def _dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """A quantized weight's own float32 dequantisation, checked.

    Raises:
        ValueError: if it has no ``dequantize`` or it returns something other than the logical shape.
    """
    if weight.dequantize is None:
        raise ValueError(f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to")
    dense = weight.dequantize()
    if not isinstance(dense, torch.Tensor):
        raise ValueError(
            f"dequantize() of scheme {weight.scheme!r} returned {type(dense).__name__}, expected a tensor"
        )
    if tuple(dense.shape) != tuple(weight.shape):
        raise ValueError(
            f"dequantize() of scheme {weight.scheme!r} returned shape {tuple(dense.shape)}, "
            f"expected {tuple(weight.shape)}"
        )
    return dense


def _repacked_gguf(weight: QuantizedWeight) -> QuantizedWeight:
    """A GGUF weight of :data:`REPACKED_SCHEMES` as Q8_0 (its ``dequantize`` the original's)."""
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    data = codes_as_q8_0(torch.as_tensor(weight.data).to("cpu"), weight.scheme, shape)
    return QuantizedWeight("gguf_q8_0", data, weight.shape, weight.dequantize, {"repacked_from": weight.scheme})
