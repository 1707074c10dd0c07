"""Host-side launchers of the mixture-of-experts kernels (:mod:`.moe_kernels`): shapes, grids and tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_plugin_sdk.gpu.triton_kernels import moe_kernels as mk
from engine_plugin_sdk.gpu.triton_kernels import moe_routing_kernels as mrk
from engine_plugin_sdk.gpu.triton_kernels import pdl
from engine_plugin_sdk.gpu.triton_kernels.launch import next_power_of_2


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Launch parameters of the MoE kernels on one target.

    Attributes:
        gemv_max_slots: batches with at most this many (token, expert) slots take the GEMV kernels, the
            rest the grouped GEMM (which reads a shared expert's weights once for all its tokens).
        gate_up_gemv: ``(block_n, block_k, num_warps)`` of the GEMV over ``gate_up`` (output rows per
            program, reduction tile, warps).
        down_gemv: the same for the GEMV over ``down``.
        down_prefetch: under PDL, at batch 1, the experts (0 to 4) whose first ``down`` tile each down GEMV
            program loads before it waits for the gate/up kernel. Not with more tokens: the tiles' registers
            then cost more programs per SM than the early loads save (H200, one Qwen3-30B-A3B layer in graphs
            with PDL, 2026-12-04: 4 experts 23.1 us against 24.8 at 1 token, 76.5 against 71.5 at 4, 134.3
            against 128.0 at 8; batch-1 decode 392.3 tok/s against 382.2 / 383.0 without).
        down_experts_at_once: the down GEMV takes a token's experts as one dimension of its tiles
            (``moe_gemv_down_experts_kernel``: their ids one load, their first tiles one gather, all in flight
            together) instead of one after another (``down_prefetch`` does not apply).
        gemm: the grouped GEMM's ``(max_slots, block_m, block_n, block_k, num_warps, num_stages)`` by batch
            size: the first entry whose ``max_slots`` covers the batch's slots (the last one past them all).
            ``block_m`` is slots per block (each expert's group is padded to a multiple of it), ``block_n``
            output columns per program, ``block_k`` the reduction tile, ``num_stages`` the pipelining depth.
        align_block_t: slots each align program scans per step.
    """

    gemv_max_slots: int = 64
    gate_up_gemv: tuple[int, int, int] = (2, 1024, 4)
    down_gemv: tuple[int, int, int] = (4, 1024, 4)
    down_prefetch: int = 4
    down_experts_at_once: bool = False
    gemm: tuple[tuple[int, int, int, int, int, int], ...] = (
        (2048, 32, 64, 64, 4, 3), (8192, 64, 64, 64, 4, 3), (0, 128, 128, 64, 8, 3),
    )  # fmt: skip
    align_block_t: int = 64

    def gemm_tiles(self, slots: int) -> tuple[int, int, int, int, int]:
        """``(block_m, block_n, block_k, num_warps, num_stages)`` of the grouped GEMM for ``slots`` slots."""
        for max_slots, *tiles in self.gemm[:-1]:
            if slots <= max_slots:
                return tuple(tiles)  # type: ignore[return-value]
        return tuple(self.gemm[-1][1:])  # type: ignore[return-value]


#: the GEMV's and grouped GEMM's tiles at one Qwen3-30B-A3B layer (128 experts, top 8, hidden 2048, expert
#: width 768) on an H200, 2026-12-02 (``benchmarks/nvidia_h200_moe.py kernels``, in CUDA graphs): 25.2 us at
#: batch 1 (3.0 TB/s of the chosen experts' bytes), 124 us at batch 8 (4.1 TB/s); the grouped GEMM wins from
#: 16 tokens (128 slots): 196 us at 16, 370 us at 256, 3.4 ms at 8192 (the defaults above)
H200_MOE_TILES = MoeTiles()
#: small tiles keep the interpreter's programs quick (``tl.dot`` needs 16 at least)
INTERPRETER_MOE_TILES = MoeTiles(
    gate_up_gemv=(32, 128, 4), down_gemv=(32, 128, 4), gemm=((0, 16, 16, 16, 4, 1),), align_block_t=16
)


def moe_topk(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
    group_score: str = "top2",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in one kernel (``engine.interfaces.moe.moe_topk``'s contract: softmax or sigmoid scores, an
    optional correction bias to choose with, group-limited choice, renormalisation, a scaling factor).

    Args:
        logits: ``[tokens, experts]`` router logits.
        top_k: experts per token.
        renormalize: scale each token's chosen weights to sum to 1.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        correction_bias: float ``[experts]`` added to the scores to choose, or None.
        num_groups: equal groups of experts; only the ``topk_groups`` best may be chosen from.
        topk_groups: groups a token may choose from.
        scaling: factor on the final weights.
        group_score: ``"top2"`` (a group's two best choices summed) or ``"max"`` (its best).

    Returns:
        float32 weights and int64 ids, both ``[tokens, top_k]``, best first.

    Raises:
        ValueError: for a ``top_k`` outside ``[1, experts]``, an unknown scoring, or groups that do not
            divide the experts or leave fewer than ``top_k`` to choose from.
    """
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    if scoring not in ("softmax", "sigmoid") or group_score not in ("top2", "max"):
        raise ValueError(f"unknown MoE scoring {scoring!r} or group score {group_score!r}")
    if experts % num_groups or not 1 <= topk_groups <= num_groups or topk_groups * (experts // num_groups) < top_k:
        raise ValueError(f"{experts} experts in {num_groups} groups, {topk_groups} chosen, cannot give top {top_k}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    group = experts // num_groups
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    mrk.moe_topk_kernel[(tokens,)](
        logits, bias, weights, ids, logits.stride(0), float(scaling),
        NUM_GROUPS=num_groups, GROUP=group, G_P2=next_power_of_2(num_groups), S_P2=next_power_of_2(group),
        TOPK_GROUPS=topk_groups, TOP_K=top_k, K_P2=next_power_of_2(top_k), SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORM=renormalize, GROUP_MAX=group_score == "max",
        LOGIT_PICKS=scoring == "softmax" and correction_bias is None and num_groups == 1,
        num_warps=max(1, min(8, next_power_of_2(experts) // 128)), **pdl.launch_options(),
    )  # fmt: skip
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * down_e(act(gate_up_e x[t]))`` with ``e = ids[t, j]``.

    Args:
        x: ``[tokens, hidden]`` activations (float32 / bfloat16 / float16).
        gate_up: stacked experts ``[E, 2 * inter, hidden]`` in ``x``'s dtype, or FP8 with ``gate_up_scale``.
        down: ``[E, hidden, inter]``, likewise (with ``down_scale``).
        topk_weights: ``[tokens, k]`` routing weights.
        topk_ids: ``[tokens, k]`` expert ids (a token may name one expert twice).
        tiles: launch parameters.
        gate_up_scale: float32 ``[E, 2 * inter]`` per-channel scales of FP8 ``gate_up``, else None.
        down_scale: float32 ``[E, hidden]`` scales of FP8 ``down``, else None.
        activation: ``"silu"`` or gpt-oss's ``"swigluoai"``.
        gate_up_bias: ``[E, 2 * inter]`` biases of ``gate_up``, or None.
        down_bias: ``[E, hidden]`` biases of ``down``, or None.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.

    Raises:
        ValueError: for shapes that do not fit together.
    """
    tokens, hidden = x.shape
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    if tuple(gate_up.shape) != (experts, 2 * inter, hidden) or tuple(down.shape) != (experts, hidden, inter):
        raise ValueError(f"experts gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not fit hidden {hidden}")
    call = moe_slots(x, inter, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x, ids, weights, top_k, slots, act, hidden_act = (
        call.x, call.ids, call.weights, call.top_k, call.slots, call.act, call.hidden_act
    )  # fmt: skip
    gu_bias, d_bias, gu_stride_be, d_stride_be = call.gate_up_bias, call.down_bias, call.gate_up_stride, call.down_stride
    fp8 = gate_up_scale is not None
    gu_scale = gate_up_scale if fp8 else weights  # any pointer: unread without HAS_SCALE
    d_scale = down_scale if down_scale is not None else weights
    gu_stride_se = gate_up_scale.stride(0) if fp8 else 0
    d_stride_se = down_scale.stride(0) if down_scale is not None else 0
    if slots <= tiles.gemv_max_slots:
        bn, bk, warps = tiles.gate_up_gemv
        mk.moe_gemv_gate_up_kernel[(slots, triton_cdiv(inter, bn))](
            x, gate_up, gu_scale, gu_bias, ids, hidden_act, inter,
            x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_act.stride(0), gu_stride_se, gu_stride_be,
            K=hidden, TOP_K=top_k, HAS_SCALE=fp8, HAS_BIAS=gate_up_bias is not None, ACT=act, BLOCK_N=bn,
            BLOCK_K=min(bk, next_power_of_2(hidden)), num_warps=warps, **pdl.launch_options(),
        )  # fmt: skip
        bn, bk, warps = tiles.down_gemv
        launch = pdl.launch_options()
        if tiles.down_experts_at_once:
            mk.moe_gemv_down_experts_kernel[(tokens, triton_cdiv(hidden, bn))](
                hidden_act, down, d_scale, d_bias, ids, weights, out, hidden,
                hidden_act.stride(0), down.stride(0), down.stride(1), out.stride(0), d_stride_se, d_stride_be,
                K=inter, TOP_K=top_k, K_P2=next_power_of_2(top_k), HAS_SCALE=down_scale is not None,
                HAS_BIAS=down_bias is not None, BLOCK_N=bn, BLOCK_K=min(bk, next_power_of_2(inter)), num_warps=warps,
                **launch,
            )  # fmt: skip
            return out
        # the early tiles exist only under PDL: elsewhere a prefetch depth would be one more variant to compile
        prefetch = tiles.down_prefetch if tokens == 1 and launch["USE_PDL"] else 0
        mk.moe_gemv_down_kernel[(tokens, triton_cdiv(hidden, bn))](
            hidden_act, down, d_scale, d_bias, ids, weights, out, hidden,
            hidden_act.stride(0), down.stride(0), down.stride(1), out.stride(0), d_stride_se, d_stride_be,
            K=inter, TOP_K=top_k, HAS_SCALE=down_scale is not None, HAS_BIAS=down_bias is not None, BLOCK_N=bn,
            BLOCK_K=min(bk, next_power_of_2(inter)), num_warps=warps, PREFETCH=prefetch, **launch,
        )  # fmt: skip
        return out
    block_m, block_n, block_k, warps, stages = tiles.gemm_tiles(slots)
    sorted_slots, block_expert, total = align_slots(ids, experts, block_m, tiles.align_block_t)
    blocks = sorted_slots.numel() // block_m
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = {"PRECISION": precision, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
              "num_warps": warps, "num_stages": stages}  # fmt: skip
    mk.moe_gemm_kernel[(blocks, triton_cdiv(inter, block_n))](
        x, gate_up, gu_scale, gu_bias, sorted_slots, block_expert, total, weights, hidden_act,
        inter, hidden, slots, x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_act.stride(0), gu_stride_se,
        gu_stride_be, A_DIV=top_k, GATED=True, MUL_WEIGHT=False, HAS_SCALE=fp8, HAS_BIAS=gate_up_bias is not None,
        ACT=act, **common,
    )  # fmt: skip
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    mk.moe_gemm_kernel[(blocks, triton_cdiv(hidden, block_n))](
        hidden_act, down, d_scale, d_bias, sorted_slots, block_expert, total, weights, per_slot,
        hidden, inter, slots, hidden_act.stride(0), down.stride(0), down.stride(1), per_slot.stride(0), d_stride_se,
        d_stride_be, A_DIV=1, GATED=False, MUL_WEIGHT=True, HAS_SCALE=down_scale is not None,
        HAS_BIAS=down_bias is not None, ACT=act, **common,
    )  # fmt: skip
    return per_slot.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


@dataclass(frozen=True, slots=True)
class MoeSlots:
    """A batch's routing in the expert kernels' form: one slot a (token, choice) pair.

    Attributes:
        x: the activations, rows contiguous.
        ids: int64 ``[slots]`` expert ids.
        weights: float32 ``[slots]`` routing weights.
        top_k: choices a token.
        slots: ``tokens * top_k``.
        act: the activation's kernel code (0 SiLU, 1 gpt-oss's clamped SwiGLU).
        hidden_act: ``[slots, inter]`` for the gate/up kernels' output.
        gate_up_bias: the gate/up biases, or any tensor where there are none (unread without ``HAS_BIAS``).
        down_bias: likewise for down.
        gate_up_stride: the gate/up biases' expert stride (0 without).
        down_stride: the down biases' (0 without).
    """

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    top_k: int
    slots: int
    act: int
    hidden_act: torch.Tensor
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    gate_up_stride: int
    down_stride: int


def moe_slots(
    x: torch.Tensor, inter: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
    gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
) -> MoeSlots:  # fmt: skip
    """Check a batch's routing and activation and lay them out for the expert kernels.

    Raises:
        ValueError: for routing that does not fit the tokens, or an unknown activation.
    """
    tokens = x.shape[0]
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != tokens:
        raise ValueError(f"routing {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)} for {tokens} tokens")
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"unknown expert activation {activation!r}")
    top_k = topk_ids.shape[1]
    weights = topk_weights.reshape(-1).float().contiguous()
    return MoeSlots(
        x=x if x.stride(-1) == 1 else x.contiguous(), ids=topk_ids.reshape(-1).contiguous(), weights=weights,
        top_k=top_k, slots=tokens * top_k, act=0 if activation == "silu" else 1,
        hidden_act=torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device),
        gate_up_bias=gate_up_bias if gate_up_bias is not None else weights,
        down_bias=down_bias if down_bias is not None else weights,
        gate_up_stride=gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        down_stride=down_bias.stride(0) if down_bias is not None else 0,
    )  # fmt: skip


def align_slots(
    ids: torch.Tensor, experts: int, block_m: int, block_t: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the slots by expert, each group padded to a multiple of ``block_m``.

    Args:
        ids: int ``[slots]`` expert ids.
        experts: how many experts there are.
        block_m: the grouped GEMM's rows per block.
        block_t: slots each program scans per step.

    Returns:
        int32 ``sorted`` slots (padding holds ``slots``), sized for the worst case; int32 expert per block of
        ``sorted``; int32 ``[1]`` padded total (blocks past it are unused).
    """
    slots = ids.numel()
    # the worst case: every non-empty group wastes block_m - 1 rows
    capacity = triton_cdiv(slots + min(experts, slots) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_expert = torch.zeros(capacity // block_m, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    block_e = next_power_of_2(experts)
    mk.moe_align_kernel[(experts,)](
        ids, sorted_slots, block_expert, total, slots,
        BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
    return sorted_slots, block_expert, total


def triton_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)
