"""Host-side launcher of the grouped-integer experts' kernels (:mod:`.moe_grouped_int_kernels`): shapes, grids,
tiles. The routing, the slots' grouping by expert and the tiles by batch size are the float experts' own
(:mod:`.moe_launchers`)."""

from __future__ import annotations

import torch

from engine_plugin_sdk.gpu.gemm import GroupedIntWeight
from engine_plugin_sdk.gpu.triton_kernels import moe_grouped_int_kernels as mik
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.moe_launchers import MoeTiles, align_slots, moe_slots, triton_cdiv


def expert_block_k(target: int, packed: int, columns: int) -> int:
    """The widest tile of whole packed blocks, at most ``max(target, packed)`` columns, that divides ``columns``
    (a multiple of ``packed``): the kernels then read no column past the reduction."""
    width = packed
    while width * 2 <= target and columns % (width * 2) == 0:
        width *= 2
    return width


def _weight_args(w: GroupedIntWeight) -> dict:
    """The kernels' pointer and layout arguments for stacked experts ``w`` (any tensor where one is unread)."""
    return {
        "w_ptr": w.codes, "scale_ptr": w.scales,
        "zs_ptr": w.zero_scales if w.zero_scales is not None else w.scales,
        "super_ptr": w.super_scales if w.sub_groups else w.scales,
        "zsuper_ptr": (w.super_zero_scales if w.super_zero_scales is not None else w.super_scales) if w.sub_groups else w.scales,
        "perm_ptr": w.perm if w.perm is not None else w.scales,
        "stride_we": w.codes.stride(0), "stride_wn": w.codes.stride(1),
        "stride_se": w.scales.stride(0), "stride_sn": w.scales.stride(1),
    }  # fmt: skip


def _form(w: GroupedIntWeight) -> dict:
    return {
        "BITS": w.bits, "ZERO": w.zero_point, "HAS_ZS": w.zero_scales is not None, "HAS_PERM": w.perm is not None,
        "PACKED": w.block_k, "GROUP": w.group_size, "SUB_GROUPS": w.sub_groups,
    }  # fmt: skip


def fused_moe_grouped_int(
    x: torch.Tensor,
    gate_up: GroupedIntWeight,
    down: GroupedIntWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * down_e(act(gate_up_e x[t]))`` with ``e = ids[t, j]``, over grouped-integer experts.

    Args:
        x: ``[tokens, hidden]`` activations (float32 / bfloat16 / float16).
        gate_up: stacked experts, ``shape`` ``(2 * inter, hidden)`` (:func:`~engine_plugin_sdk.gpu.moe.stack_grouped_int`).
        down: stacked experts, ``shape`` ``(hidden, inter)``.
        topk_weights: ``[tokens, k]`` routing weights.
        topk_ids: ``[tokens, k]`` expert ids (a token may name one expert twice).
        tiles: launch parameters (the GEMV's and the grouped GEMM's ``block_k`` are rounded to whole packed
            blocks that divide the reduction).
        activation: ``"silu"`` or gpt-oss's ``"swigluoai"``.
        gate_up_bias: ``[E, 2 * inter]`` biases of ``gate_up``, or None.
        down_bias: ``[E, hidden]`` biases of ``down``, or None.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.

    Raises:
        ValueError: for shapes that do not fit together, 6-bit codes, or an unknown activation.
    """
    tokens, hidden = x.shape
    two_inter, _ = gate_up.shape
    inter = two_inter // 2
    experts = int(gate_up.codes.shape[0])
    if tuple(gate_up.shape) != (2 * inter, hidden) or tuple(down.shape) != (hidden, inter):
        raise ValueError(f"experts gate_up {gate_up.shape} / down {down.shape} do not fit hidden {hidden}")
    if gate_up.bits not in (4, 8) or down.bits not in (4, 8):
        raise ValueError(f"grouped-integer experts take 4- or 8-bit codes, got {gate_up.bits} / {down.bits}")
    call = moe_slots(x, inter, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x, ids, weights, top_k, slots, act, hidden_act = (
        call.x, call.ids, call.weights, call.top_k, call.slots, call.act, call.hidden_act
    )  # fmt: skip
    gu_bias, d_bias, gu_stride_be, d_stride_be = call.gate_up_bias, call.down_bias, call.gate_up_stride, call.down_stride
    if slots <= tiles.gemv_max_slots:
        bn, bk, warps = tiles.gate_up_gemv
        mik.moe_int_gemv_gate_up_kernel[(slots, triton_cdiv(inter, bn))](
            x_ptr=x, bias_ptr=gu_bias, ids_ptr=ids, out_ptr=hidden_act, INTER=inter, stride_x=x.stride(0),
            stride_o=hidden_act.stride(0), stride_be=gu_stride_be, K=hidden, TOP_K=top_k,
            HAS_BIAS=gate_up_bias is not None, ACT=act, BLOCK_N=bn, BLOCK_K=expert_block_k(bk, gate_up.block_k, hidden),
            num_warps=warps, **_weight_args(gate_up), **_form(gate_up), **pdl.launch_options(),
        )  # fmt: skip
        bn, bk, warps = tiles.down_gemv
        mik.moe_int_gemv_down_kernel[(tokens, triton_cdiv(hidden, bn))](
            act_ptr=hidden_act, bias_ptr=d_bias, ids_ptr=ids, topw_ptr=weights, out_ptr=out, H=hidden,
            stride_a=hidden_act.stride(0), stride_o=out.stride(0), stride_be=d_stride_be, K=inter, TOP_K=top_k,
            HAS_BIAS=down_bias is not None, BLOCK_N=bn, BLOCK_K=expert_block_k(bk, down.block_k, inter),
            num_warps=warps, **_weight_args(down), **_form(down), **pdl.launch_options(),
        )  # fmt: skip
        return out
    block_m, block_n, block_k, warps, stages = tiles.gemm_tiles(slots)
    sorted_slots, block_expert, total = align_slots(ids, experts, block_m, tiles.align_block_t)
    blocks = sorted_slots.numel() // block_m
    common = {
        "sorted_ptr": sorted_slots, "block_expert_ptr": block_expert, "total_ptr": total, "topw_ptr": weights,
        "num_slots": slots, "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32", "ACT": act,
        "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
    }  # fmt: skip
    mik.moe_int_gemm_kernel[(blocks, triton_cdiv(inter, block_n))](
        a_ptr=x, bias_ptr=gu_bias, c_ptr=hidden_act, N=inter, K=hidden, stride_am=x.stride(0),
        stride_cm=hidden_act.stride(0), stride_be=gu_stride_be, A_DIV=top_k, GATED=True, MUL_WEIGHT=False,
        HAS_BIAS=gate_up_bias is not None, BLOCK_K=expert_block_k(block_k, gate_up.block_k, hidden),
        **_weight_args(gate_up), **_form(gate_up), **common, **pdl.launch_options(),
    )  # fmt: skip
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    mik.moe_int_gemm_kernel[(blocks, triton_cdiv(hidden, block_n))](
        a_ptr=hidden_act, bias_ptr=d_bias, c_ptr=per_slot, N=hidden, K=inter, stride_am=hidden_act.stride(0),
        stride_cm=per_slot.stride(0), stride_be=d_stride_be, A_DIV=1, GATED=False, MUL_WEIGHT=True,
        HAS_BIAS=down_bias is not None, BLOCK_K=expert_block_k(block_k, down.block_k, inter),
        **_weight_args(down), **_form(down), **common, **pdl.launch_options(),
    )  # fmt: skip
    return per_slot.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
