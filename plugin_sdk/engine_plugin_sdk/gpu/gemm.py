"""GEMM on a torch GPU: bf16 / fp16 / fp32 through torch (cuBLAS / hipBLASLt), FP8 e4m3 weights through
torch's scaled matmul, grouped integer weights (``int4_grouped`` / ``int8_grouped``, and the GGUF types
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K .. Q6_K / IQ4_NL / IQ4_XS repacked exactly into that form, :mod:`~engine_plugin_sdk.grouped_codes`)
through a Triton weight-only GEMM, or a GEMV for a single row, that dequantize in registers
(:mod:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_kernels`), and batched LoRA adapters through two
Triton kernels that read each row's slot on the device
(:mod:`~engine_plugin_sdk.gpu.triton_kernels.lora_kernels`).

FP8 weights: :mod:`engine_plugin_sdk.gpu.fp8_gemm`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.interfaces.gemm import (
    ACTIVATIONS_KEY,
    PER_TOKEN_ACTIVATIONS,
    GemmBackend,
    QuantizedWeight,
    RowQuantizedActivations,
)
from engine.interfaces.grouped_int import GROUPED_INT_BITS
from engine_plugin_sdk.dtypes import torch_dtype
from engine_plugin_sdk.gpu.fp8_gemm import (
    FP8_MAX,
    FP8_SCHEME,
    Fp8Weight,
    dequantize_rows,
    e4m3fn_to_fnuz,
    fp8_linear,
    fp8_shape_ok,
)
from engine_plugin_sdk.gpu.grouped_int_weight import GroupedIntRowBlocks, GroupedIntWeight
from engine_plugin_sdk.gpu.moe import StackedExperts, stack_experts
from engine_plugin_sdk.grouped_codes import GGUF_GROUPED_SCHEMES, grouped_form

#: the dtypes weights and activations run in (FP8 weights are kept apart, as :class:`Fp8Weight`)
GEMM_DTYPES = ("float32", "bfloat16", "float16")
#: the gated activations the Triton kernels run (:meth:`TorchGemmBackend.gated_linear`)
GATED_ACTIVATIONS = frozenset({"silu", "gelu_tanh"})
#: the weight-only schemes the Triton GEMM runs (:class:`GroupedIntWeight`): the grouped integer ones and
#: the GGUF types repacked into them exactly (the others are dequantized at load)
GROUPED_INT_SCHEMES = frozenset(GROUPED_INT_BITS) | GGUF_GROUPED_SCHEMES


class TorchGemmBackend(GemmBackend):
    """``torch.nn.functional.linear`` on the GPU; FP8 e4m3 weights stay FP8 where the GPU has FP8 units, and
    grouped integer weights stay in their codes where the Triton kernels run (on the GPU, or in the
    interpreter when the platform turns :attr:`triton_grouped_int` on).

    Args:
        device: where weights go.
        fp8_dtype: the GPU's FP8 dtype name (``"float8_e4m3fn"``, or ``"float8_e4m3fnuz"`` on MI300),
            or None: ``fp8_e4m3`` weights are then dequantized at load like every other scheme.

    Raises:
        ValueError: for an FP8 dtype name that is not an e4m3 flavour.
    """

    def __init__(self, device: Any, fp8_dtype: str | None = None) -> None:
        if fp8_dtype is not None and fp8_dtype not in FP8_MAX:
            raise ValueError(f"fp8_dtype must be one of {sorted(FP8_MAX)} or None, got {fp8_dtype!r}")
        self.device = torch.device(device)
        self.fp8_dtype = fp8_dtype
        #: run mixtures of experts through the shared Triton kernels (on the GPU; the platform also turns
        #: this on in interpreter mode) rather than one ``linear`` per expert
        self.triton_moe = self.device.type == "cuda"
        #: the MoE kernels' :class:`~engine_plugin_sdk.gpu.triton_kernels.moe_launchers.MoeTiles`, None
        #: for their defaults (kept as None here so that constructing a backend does not import Triton)
        self.moe_tiles: Any = None
        #: keep ``int4_grouped`` / ``int8_grouped`` weights and the GGUF types of :data:`GROUPED_INT_SCHEMES`
        #: quantized for the Triton weight-only kernels (on the GPU; the platform also turns this on in
        #: interpreter mode), else dequantize them at load
        self.triton_grouped_int = self.device.type == "cuda"
        #: that GEMM's :class:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles.GroupedIntTiles`,
        #: None for its H200 defaults (kept as None so that constructing a backend does not import Triton)
        self.grouped_int_tiles: Any = None
        #: run batched LoRA through the shared Triton kernels (on the GPU; the platform also turns this on in
        #: interpreter mode): their plan is the device's slots alone, so a step can be recorded in a graph
        self.triton_lora = self.device.type == "cuda"
        #: the LoRA kernels' :class:`~engine_plugin_sdk.gpu.triton_kernels.lora_launchers.LoraTiles`, None
        #: for their defaults (kept as None so that constructing a backend does not import Triton)
        self.lora_tiles: Any = None
        #: run :meth:`gated_linear`'s activation through the Triton kernels (on the GPU; the platform also
        #: turns this on in interpreter mode), else claim no gated activation
        self.triton_gated = self.device.type == "cuda"
        #: take the residual norm before a mixture of experts' router into the router's single-row product
        #: (:meth:`add_rms_norm_router`): off on GPUs until timed on one against the norm's own launch; the
        #: platform turns it on in interpreter mode, which checks it
        self.triton_router_norm = False
        #: take a layer's residual norm into the single-row product of a plain float weight that reads it (the
        #: attention's q/k/v; :meth:`add_rms_norm_linear`), every program summing the row itself: off unless a
        #: plugin asks (its tile, or None for a weight it leaves to the norm kernel: :meth:`_linear_norm_tile`)
        self.triton_linear_norm = False

    @property
    def gated_activations(self) -> frozenset[str]:  # type: ignore[override]
        """Both gated activations wherever the Triton kernels run."""
        return GATED_ACTIVATIONS if self.triton_gated else frozenset()

    @property
    def supported_quant_schemes(self) -> frozenset[str]:  # type: ignore[override]
        """FP8 where the GPU has FP8 units; the grouped integer schemes and the GGUF types repacked into
        them where the Triton kernels run."""
        fp8 = frozenset({FP8_SCHEME}) if self.fp8 else frozenset()
        return fp8 | (GROUPED_INT_SCHEMES if self.triton_grouped_int else frozenset())

    @property
    def fp8(self) -> bool:
        """Whether ``fp8_e4m3`` weights stay FP8."""
        return self.fp8_dtype is not None

    def prepare_weight(self, weight: Any, dtype: Any) -> Any:
        target = torch_dtype(dtype, supported=GEMM_DTYPES)
        if isinstance(weight, QuantizedWeight):
            if weight.scheme == FP8_SCHEME and self.fp8 and fp8_shape_ok(weight.shape):
                return self._prepare_fp8(weight)
            if weight.scheme in GROUPED_INT_SCHEMES and self.triton_grouped_int:
                packed = self._prepare_grouped_int(weight, target)
                if packed is not None:
                    return packed
            weight = dequantize_checked(weight)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"cannot prepare a weight of type {type(weight).__name__}; expected a float tensor")
        return weight.to(device=self.device, dtype=target).contiguous()

    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias)
        if isinstance(x, RowQuantizedActivations):
            x = dequantize_rows(x)
        if isinstance(weight, GroupedIntWeight):
            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear

            return grouped_int_linear(x, weight, bias, self._grouped_int_tiles())
        if isinstance(weight, GroupedIntRowBlocks):
            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_row_blocks_launchers import (
                row_blocks_linear,
            )

            return row_blocks_linear(x, weight, bias, self._grouped_int_tiles())
        return torch.nn.functional.linear(x, weight, bias)

    def join_row_blocks(self, parts: Any, rows: Any) -> Any | None:
        """Blocks that stayed grouped-integer codes over one input width, as a :class:`GroupedIntRowBlocks`, where
        one launch takes a row through them (``dot_gemv_row_blocks`` and their forms and rows, :func:`~engine_plugin_sdk.gpu.triton_kernels.grouped_int_row_blocks_launchers.joinable`);
        else None: the core's views of each block's product then copy nothing."""
        parts, rows = tuple(parts), tuple(int(n) for n in rows)
        if len(parts) != len(rows):
            return None
        if not all(isinstance(p, GroupedIntWeight) and p.shape[0] == n for p, n in zip(parts, rows, strict=True)):
            return None
        if len({p.shape[1] for p in parts}) != 1:
            return None
        from engine_plugin_sdk.gpu.triton_kernels.grouped_int_row_blocks_launchers import joinable

        return GroupedIntRowBlocks(parts, rows) if joinable(parts, rows, self._grouped_int_tiles()) else None

    def gated_linear(self, x: Any, weight: Any, activation: str) -> Any:
        """The product, then the Triton gated activation (a vendor's backend fuses the single-row case; 4-bit
        grouped weights fuse it in the fragment kernel where that takes the rows)."""
        from engine_plugin_sdk.gpu.triton_kernels import launchers
        from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import GATED_ACTIVATIONS

        act = {"silu": launchers.silu_and_mul, "gelu_tanh": launchers.gelu_tanh_and_mul}.get(activation)
        if act is None or activation not in self.gated_activations:
            return super().gated_linear(x, weight, activation)
        if isinstance(weight, GroupedIntWeight) and not isinstance(x, RowQuantizedActivations):
            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_gated_linear

            fused = grouped_int_gated_linear(x, weight, GATED_ACTIVATIONS[activation], self._grouped_int_tiles())
            if fused is not None:
                return fused
        return act(self.linear(x, weight))

    @property
    def fuses_residual_norm(self) -> bool:  # type: ignore[override]
        """Where :attr:`triton_linear_norm` asks for it, or the grouped-integer tiles do (``dot_gemv_residual_norm``
        or ``dot_gemv_prepared``; the defaults do not) and the Triton kernels run. Read by every layer of an eager
        step: no import, no tiles built."""
        return self.triton_linear_norm or self._grouped_int_norm()

    def _grouped_int_norm(self) -> bool:
        tiles = self.grouped_int_tiles
        return (
            self.triton_grouped_int and self.triton_gated and tiles is not None
            and (tiles.dot_gemv_residual_norm or tiles.dot_gemv_prepared)
        )  # fmt: skip

    def add_rms_norm_linear(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, weight: Any, bias: Any | None = None,
        activation: str | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        """The integer-dot GEMV with the norm in its programs or handed the row converted, where it takes the row
        (one row of a single-step grouped-integer product); one row against a plain float weight, not gated, with
        :attr:`triton_linear_norm`: the GEMV that sums and normalises the row in each program; else the Triton norm,
        then :meth:`linear` or :meth:`gated_linear`."""
        if not self.fuses_residual_norm:
            return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, activation)
        from engine_plugin_sdk.gpu.triton_kernels import launchers
        from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import GATED_ACTIVATIONS

        if activation is not None and activation not in self.gated_activations:
            raise ValueError(f"{type(self).__name__} gates {sorted(self.gated_activations)}, not {activation!r}")
        if isinstance(weight, GroupedIntWeight) and self._grouped_int_norm():
            from engine_plugin_sdk.gpu.triton_kernels import grouped_int_gemv_rows as gated_rows
            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_norm_launchers import (
                grouped_int_add_rms_norm_linear,
            )

            gated = gated_rows.NOT_GATED if activation is None else GATED_ACTIVATIONS[activation]
            fused = grouped_int_add_rms_norm_linear(
                x, residual, norm_weight, eps, weight, bias, self._grouped_int_tiles(), gated
            )
            if fused is not None:
                return fused
        elif self.triton_linear_norm and activation is None and _float_single_row(x, residual, weight):
            from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import add_rms_norm_gemv

            tile = self._linear_norm_tile(weight)
            if tile is not None:
                product, _, summed = add_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias, **tile)
                return product, summed
        normed, summed = launchers.fused_add_rms_norm(x, residual, norm_weight, eps)
        if activation is None:
            return self.linear(normed, weight, bias), summed
        return self.gated_linear(normed, weight, activation), summed

    @property
    def fuses_router_norm(self) -> bool:  # type: ignore[override]
        """Where :attr:`triton_router_norm` asks for it."""
        return self.triton_router_norm

    def add_rms_norm_router(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, router: Any, bias: Any | None = None
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        """One row against a plain float router: the Triton GEMV that sums and normalises the row in each program
        (:func:`~engine_plugin_sdk.gpu.triton_kernels.gemv_launchers.add_rms_norm_gemv`); else the Triton norm,
        then :meth:`linear`."""
        if not self.fuses_router_norm:
            return super().add_rms_norm_router(x, residual, norm_weight, eps, router, bias)
        from engine_plugin_sdk.gpu.triton_kernels import launchers

        if _float_single_row(x, residual, router):
            from engine_plugin_sdk.gpu.triton_kernels.gemv_launchers import add_rms_norm_gemv

            return add_rms_norm_gemv(x, residual, norm_weight, eps, router, bias, **self._router_norm_tile())
        normed, summed = launchers.fused_add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, router, bias), normed, summed

    def _router_norm_tile(self) -> dict[str, int]:
        """The launch parameters of :meth:`add_rms_norm_router`'s GEMV (a plugin's override: its own GEMV tile)."""
        return {}

    def _linear_norm_tile(self, weight: torch.Tensor) -> dict[str, int] | None:
        """The launch parameters of :meth:`add_rms_norm_linear`'s float GEMV for ``weight``, or None to leave its
        norm to the norm kernel (a plugin's override: where the programs' sums of the row cost more than a launch)."""
        return {}

    def logits(self, x: Any, weight: Any) -> Any:
        if isinstance(weight, GroupedIntWeight) and not isinstance(x, RowQuantizedActivations):
            from engine_plugin_sdk.gpu.triton_kernels.grouped_int_launchers import grouped_int_linear

            # float32 straight from the accumulator: no rounding to the activation dtype first
            return grouped_int_linear(x, weight, None, self._grouped_int_tiles(), out_dtype=torch.float32)
        return super().logits(x, weight)

    def prepare_experts(
        self, gate_up: list[Any], down: list[Any], dtype: Any, gate_up_bias: list[Any] | None = None,
        down_bias: list[Any] | None = None,
    ) -> Any:  # fmt: skip
        if not self.triton_moe:
            return super().prepare_experts(gate_up, down, dtype, gate_up_bias, down_bias)
        target = torch_dtype(dtype, supported=GEMM_DTYPES)
        if self.triton_grouped_int:
            packed = self._prepare_grouped_int_experts(gate_up, down, target, gate_up_bias, down_bias)
            if packed is not None:
                return packed
        # the Triton kernels read OCP e4m3 only: MI300's fnuz flavour dequantizes instead
        fp8 = self.fp8_dtype == "float8_e4m3fn"
        return stack_experts(gate_up, down, target, self.device, fp8, gate_up_bias, down_bias)

    def _prepare_grouped_int_experts(
        self, gate_up: list[Any], down: list[Any], dtype: torch.dtype, gate_up_bias: list[Any] | None,
        down_bias: list[Any] | None,
    ) -> Any | None:  # fmt: skip
        """Grouped-integer experts kept in their codes, or None where either projection's experts are not all
        of one grouped-integer form (they are then stacked as :func:`stack_experts` has them)."""
        from engine_plugin_sdk.gpu.grouped_int_experts import GroupedIntExperts, stack_grouped_int

        two_level = self._grouped_int_tiles().two_level_scales
        packed_gate_up = stack_grouped_int(gate_up, self.device, two_level)
        packed_down = None if packed_gate_up is None else stack_grouped_int(down, self.device, two_level)
        if packed_down is None:
            return None
        biases = [
            None if b is None else torch.stack([torch.as_tensor(t) for t in b]).to(self.device, dtype).contiguous()
            for b in (gate_up_bias, down_bias)
        ]
        return GroupedIntExperts(packed_gate_up, packed_down, *biases)

    def fused_moe(self, x: Any, experts: Any, topk_weights: Any, topk_ids: Any, activation: str = "silu") -> Any:
        from engine_plugin_sdk.gpu.grouped_int_experts import GroupedIntExperts

        if isinstance(experts, GroupedIntExperts):
            from engine_plugin_sdk.gpu.triton_kernels.moe_grouped_int_launchers import fused_moe_grouped_int

            return fused_moe_grouped_int(
                x, experts.gate_up, experts.down, topk_weights, topk_ids, self._moe_tiles(), activation,
                experts.gate_up_bias, experts.down_bias,
            )  # fmt: skip
        if not isinstance(experts, StackedExperts):
            return super().fused_moe(x, experts, topk_weights, topk_ids, activation)
        from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import fused_moe

        return fused_moe(
            x, experts.gate_up, experts.down, topk_weights, topk_ids, self._moe_tiles(),
            gate_up_scale=experts.gate_up_scale, down_scale=experts.down_scale, activation=activation,
            gate_up_bias=experts.gate_up_bias, down_bias=experts.down_bias,
        )  # fmt: skip

    def plan_lora(self, step: Any) -> Any:
        """The step's rows sorted by slot on the device (once per step for every projection): the kernels
        read them there, and ``token_slots_cpu`` is never touched, so the plan is the same while a graph
        is recorded."""
        if not self.triton_lora:
            return super().plan_lora(step)
        from engine_plugin_sdk.gpu.triton_kernels.lora_launchers import sort_lora_rows

        return sort_lora_rows(step.token_slots)

    def add_lora(self, y: Any, x: Any, weights: Any, plan: Any) -> None:
        if not self.triton_lora:
            super().add_lora(y, x, weights, plan)
            return
        from engine_plugin_sdk.gpu.triton_kernels.lora_launchers import add_lora

        if isinstance(x, RowQuantizedActivations):
            x = dequantize_rows(x)
        add_lora(y, x, weights, plan, self.lora_tiles)

    def row_quantized_input(self, weight: Any) -> Any | None:
        """The weight's FP8 dtype for a W8A8 weight (its activations take one FP8 term per row, which the
        producing op can write itself), else None."""
        if isinstance(weight, Fp8Weight) and weight.per_token_activations:
            return weight.data.dtype
        return None

    def _grouped_int_tiles(self) -> Any:
        from engine_plugin_sdk.gpu.triton_kernels.grouped_int_tiles import GroupedIntTiles

        return self.grouped_int_tiles or GroupedIntTiles()

    def _moe_tiles(self) -> Any:
        """The MoE kernels' tiles: ``moe_tiles``, or their defaults (a plugin picks its own by the GPU)."""
        from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles

        return self.moe_tiles or MoeTiles()

    def _prepare_grouped_int(self, weight: QuantizedWeight, dtype: torch.dtype) -> GroupedIntWeight | None:
        """The weight repacked for the Triton kernels with ``dtype`` activations, or None for a group size
        whose largest power-of-two divisor is below the kernel's smallest tile (it is dequantized instead)."""
        from engine_plugin_sdk.gpu.triton_kernels import grouped_int_packing as gil

        tiles = self._grouped_int_tiles()
        widest = tiles.fp32_block_k if dtype == torch.float32 else tiles.block_k
        form = grouped_form(weight)
        block_k = None if form is None else gil.grouped_int_block_k(form[1], form[0], widest)
        if block_k is None:
            return None
        six_bit = tiles.six_bit_codes or 0 < tiles.six_bit_min_rows <= weight.shape[0]
        return gil.pack_grouped_int(weight, block_k, self.device, two_level=tiles.two_level_scales, six_bit=six_bit)

    def _prepare_fp8(self, weight: QuantizedWeight) -> Fp8Weight:
        out_features, _ = weight.shape
        data = torch.as_tensor(weight.data)
        if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != tuple(weight.shape):
            raise ValueError(
                f"fp8_e4m3 weight data must be float8_e4m3fn {tuple(weight.shape)}, got {data.dtype} {tuple(data.shape)}"
            )
        scale = torch.as_tensor(weight.extra.get("scale", 1.0), dtype=torch.float32).reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(out_features)
        if scale.numel() != out_features:
            raise ValueError(f"fp8_e4m3 scale must hold 1 or {out_features} values, got {scale.numel()}")
        if self.fp8_dtype == "float8_e4m3fnuz":
            data, scale = e4m3fn_to_fnuz(data, scale)
        return Fp8Weight(
            data=data.to(self.device).contiguous(),
            scale=scale.to(self.device).reshape(1, out_features).contiguous(),
            shape=tuple(weight.shape),
            per_token_activations=weight.extra.get(ACTIVATIONS_KEY) == PER_TOKEN_ACTIVATIONS,
        )


def dequantize_checked(weight: QuantizedWeight) -> torch.Tensor:
    """The dense float32 weight of a quantized one, checked.

    Raises:
        ValueError: when the scheme has no working ``dequantize``.
    """
    if weight.dequantize is None:
        raise ValueError(f"quantized weight of scheme {weight.scheme!r} has no dequantize() to fall back to")
    dense = weight.dequantize()
    if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != tuple(weight.shape):
        raise ValueError(f"dequantize() of scheme {weight.scheme!r} did not return a {tuple(weight.shape)} tensor")
    return dense


def _float_single_row(x: Any, residual: Any, weight: Any) -> bool:
    """Whether the GEMV with the norm in its programs takes this product: one row against a contiguous weight of the
    row's own float dtype (not FP8, not packed)."""
    return (
        isinstance(weight, torch.Tensor) and weight.dtype == x.dtype and weight.stride(-1) == 1
        and x.numel() == weight.shape[1] and residual.numel() == x.numel()
    )  # fmt: skip
