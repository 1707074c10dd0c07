"""Reference implementations of every op a plugin provides, in float64, written the plain way.

These are the ground truth of the conformance suite: short, loop-over-sequences, no paging tricks.
The core's own op implementations (:mod:`engine.interfaces.ops`) are what a model runs when a platform
overrides nothing; these are what everything, including those, is checked against.

The canonical KV layout used here is one tensor of keys and one of values, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is block ``s // block_size``,
offset ``s % block_size``.
"""

from __future__ import annotations

import math

import torch

from engine.interfaces.gemm import QuantizedWeight

F64 = torch.float64


def ref_attention(
    query: torch.Tensor,
    key_history: list[torch.Tensor],
    value_history: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over each sequence's full key/value history.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns ``query_lens[i]`` consecutive rows,
            which are the last positions of its history.
        key_history: per sequence ``[context_len, num_kv_heads, head_dim]``, new tokens included.
        value_history: like ``key_history``.
        query_lens: new tokens per sequence.
        scale: softmax scale.
        causal: mask keys after the query's position.
        sliding_window: a query at position p sees only positions > p - sliding_window; when not
            ``causal`` the window is symmetric, only positions j with ``|p - j| < sliding_window``.
        logits_soft_cap: scores become ``cap * tanh(scores / cap)``.
        sinks: ``[num_heads]``: one more softmax term per head, ``exp(sinks[h])``, with no value.

    Returns:
        float64 ``[num_tokens, num_heads, head_dim]``.

    Raises:
        ValueError: when the shapes do not fit together.
    """
    if len(key_history) != len(query_lens) or len(value_history) != len(query_lens):
        raise ValueError("key_history, value_history and query_lens must have one entry per sequence")
    if sum(query_lens) != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} rows but query_lens sum to {sum(query_lens)}")
    num_heads = query.shape[1]
    outputs = []
    start = 0
    for keys, values, q_len in zip(key_history, value_history, query_lens, strict=True):
        ctx = keys.shape[0]
        if q_len > ctx:
            raise ValueError(f"a sequence has {q_len} new tokens but a context of only {ctx}")
        kv_heads = keys.shape[1]
        if num_heads % kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} KV heads")
        group = num_heads // kv_heads
        # the reference runs on the host: a plugin's query may live on its device
        q = query[start : start + q_len].to("cpu", F64)
        start += q_len
        # expand KV heads so that query head h reads KV head h // group (GQA / MQA)
        k = keys.to("cpu", F64).repeat_interleave(group, dim=1)
        v = values.to("cpu", F64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        allowed = torch.ones(q_len, ctx, dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
            if not causal:
                allowed &= k_pos < q_pos + sliding_window
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            # the sink's column joins the softmax and leaves without a value
            sink_column = sinks.to("cpu", F64).view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :ctx]
        else:
            probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outputs, dim=0) if outputs else query.new_zeros(query.shape, dtype=F64)


def ref_gather_history(
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, block_table: list[int], context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one sequence's first ``context_len`` keys and values out of a paged cache by its block table.

    Args:
        key_blocks: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        value_blocks: like ``key_blocks``.
        block_table: the sequence's physical block ids in logical order.
        context_len: tokens to read.

    Returns:
        ``(keys, values)``, each ``[context_len, num_kv_heads, head_dim]``.
    """
    block_size = key_blocks.shape[1]
    needed = -(-context_len // block_size)
    ids = torch.tensor(block_table[:needed], dtype=torch.long, device=key_blocks.device)
    keys = key_blocks.index_select(0, ids).flatten(0, 1)[:context_len]
    values = value_blocks.index_select(0, ids).flatten(0, 1)[:context_len]
    return keys, values


def ref_paged_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention over a paged cache the plain way: gather each sequence's blocks, then :func:`ref_attention`.

    The cache must already hold every token, new ones included.

    Returns:
        float64 ``[num_tokens, num_heads, head_dim]``.
    """
    keys, values = [], []
    for table, ctx in zip(block_tables, seq_lens, strict=True):
        k, v = ref_gather_history(key_blocks, value_blocks, table, ctx)
        keys.append(k)
        values.append(v)
    return ref_attention(query, keys, values, query_lens, scale, causal, sliding_window, logits_soft_cap)


def ref_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache after storing ``key``/``value`` at ``slot_mapping`` (negative slots skipped); inputs untouched.

    Returns:
        New ``(key_blocks, value_blocks)`` in the input dtype.
    """
    num_blocks, block_size = key_blocks.shape[:2]
    keys = key_blocks.clone().flatten(0, 1)
    values = value_blocks.clone().flatten(0, 1)
    for row, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        if slot >= num_blocks * block_size:
            raise ValueError(f"slot {slot} is outside a cache of {num_blocks} blocks of {block_size}")
        keys[slot] = key[row].to(keys.dtype)
        values[slot] = value[row].to(values.dtype)
    return keys.view_as(key_blocks), values.view_as(value_blocks)


def ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float64."""
    out = x.to(F64) @ weight.to(F64).T
    if bias is not None:
        out = out + bias.to(F64)
    return out


def ref_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float64 ``[out, in]`` weight a quantized weight stands for, through its own ``dequantize``.

    Raises:
        ValueError: when ``dequantize`` is missing or returns the wrong shape.
    """
    if weight.dequantize is None:
        raise ValueError(f"quantized weight of scheme {weight.scheme!r} has no dequantize()")
    dense = torch.as_tensor(weight.dequantize()).to(F64)
    if tuple(dense.shape) != tuple(weight.shape):
        raise ValueError(f"dequantize() gave shape {tuple(dense.shape)}, expected {tuple(weight.shape)}")
    return dense


def ref_quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference GEMM of a quantized weight: dequantize, then :func:`ref_linear`."""
    return ref_linear(x, ref_dequantize(weight), bias)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float64."""
    xf = x.to(F64)
    return xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64)


def ref_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in float64."""
    summed = x.to(F64) + residual.to(F64)
    return ref_rms_norm(summed, weight, eps), summed


def ref_post_norm_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(rms_norm(x, post_weight) + residual, weight), rms_norm(x, post_weight) + residual)`` in
    float64."""
    return ref_fused_add_rms_norm(ref_rms_norm(x, post_weight, eps), residual, weight, eps)


def make_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """float32 ``[max_position, rotary_dim]``: cos of every (position, frequency) then sin, as the core's op takes."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim))
    angles = torch.arange(max_position, dtype=F64).unsqueeze(1) * inv_freq.unsqueeze(0)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def ref_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding in float64, written as the complex rotation it is.

    Pairs ``(t[i], t[i + d/2])`` are rotated by angle ``position * freq[i]``.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.to(F64)[positions.long()]
    angle = torch.atan2(cs[:, half:], cs[:, :half]).unsqueeze(1)
    rotation = torch.polar(torch.ones_like(angle), angle)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = t.to(F64)
        as_complex = torch.complex(tf[..., :half], tf[..., half:]) * rotation
        return torch.cat((as_complex.real, as_complex.imag), dim=-1)

    return rotate(query), rotate(key)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in float64."""
    xf = x.to(F64)
    d = xf.shape[-1] // 2
    gate = xf[..., :d]
    return gate / (1.0 + torch.exp(-gate)) * xf[..., d:]


def ref_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` in float64 (GeGLU with the tanh-approximated GELU)."""
    xf = x.to(F64)
    d = xf.shape[-1] // 2
    gate = xf[..., :d]
    inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
    return 0.5 * gate * (1.0 + torch.tanh(inner)) * xf[..., d:]


def ref_gated_linear(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x @ G.T) * (x @ U.T)`` in float64, ``weight`` stacking the gate's rows over the up rows
    (:meth:`GemmBackend.gated_linear`).

    Raises:
        ValueError: for an activation other than ``"silu"`` and ``"gelu_tanh"``.
    """
    gated = {"silu": ref_silu_and_mul, "gelu_tanh": ref_gelu_tanh_and_mul}.get(activation)
    if gated is None:
        raise ValueError(f"unknown gated activation {activation!r} (known: silu, gelu_tanh)")
    return gated(ref_linear(x, weight))


def ref_add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None, activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(product of rms_norm(x + residual) * norm_weight, x + residual)`` in float64, the product plain (with
    ``bias``) or gated by ``activation`` (:meth:`GemmBackend.add_rms_norm_linear`)."""
    normed, summed = ref_fused_add_rms_norm(x, residual, norm_weight, eps)
    if activation is None:
        return ref_linear(normed, weight, bias), summed
    return ref_gated_linear(normed, weight, activation), summed


def ref_add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, rms_norm(x + residual) * norm_weight, x + residual)`` in float64, the logits the router's product
    of the normalised rows (:meth:`GemmBackend.add_rms_norm_router`)."""
    normed, summed = ref_fused_add_rms_norm(x, residual, norm_weight, eps)
    return ref_linear(normed, router, bias), normed, summed


def ref_linear_activation(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in float64 (:meth:`GemmBackend.linear_activation`).

    Raises:
        ValueError: for an activation other than ``"gelu"`` (exact, erf).
    """
    if activation != "gelu":
        raise ValueError(f"unknown fused activation {activation!r} (known: gelu)")
    return torch.nn.functional.gelu(ref_linear(x, weight, bias))


def ref_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (biased variance) in float64; ``bias`` None for none."""
    xf = x.to(F64)
    centred = xf - xf.mean(-1, keepdim=True)
    out = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64)
    return out if bias is None else out + bias.to(F64)


def ref_add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """:func:`ref_layer_norm` of ``x + residual`` in float64."""
    return ref_layer_norm(x.to(F64) + residual.to(F64), weight, bias, eps)


def ref_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
    """The logits in float64 with every token the bitmask disallows at ``-inf`` (a new tensor).

    Bit ``c % 32`` of word ``c // 32`` allows column ``c``; columns past the bitmask's ``32 * words``
    are disallowed; only the rows in ``indices`` (all when None) are masked.
    """
    out = logits.to(F64).cpu().clone()
    words = bitmask.cpu().to(torch.int64) & 0xFFFFFFFF  # the unsigned word, so shifts need no sign care
    cols = torch.arange(out.shape[1])
    covered = cols < 32 * words.shape[1]
    word_of = cols.clamp(max=32 * words.shape[1] - 1) // 32
    rows = range(out.shape[0]) if indices is None else indices.cpu().tolist()
    for r in rows:
        allowed = ((words[r, word_of] >> (cols % 32)) & 1).bool() & covered
        out[r, ~allowed] = float("-inf")
    return out


def ref_moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
    group_score: str = "top2",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in float64, token by token: scores (softmax over the experts, or a sigmoid each), plus the
    correction bias to choose with; only the ``topk_groups`` groups with the best sums of their two best
    choice scores (or best single one, ``group_score="max"``) compete; the ``top_k`` best choices, weighted by their unbiased scores (scaled to sum to 1
    when ``renormalize``), times ``scaling``. Returns float64 weights and int64 ids, ``[tokens, top_k]``."""
    logits = router_logits.to(F64).cpu()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else 1.0 / (1.0 + torch.exp(-logits))
    choice = scores + (0.0 if correction_bias is None else correction_bias.to(F64).cpu())
    tokens, experts = choice.shape
    per_group = experts // num_groups
    weights = torch.zeros(tokens, top_k, dtype=F64)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    for t in range(tokens):
        row = choice[t].clone()
        if num_groups > 1:
            best_n = 1 if group_score == "max" else 2
            sums = [sorted(row[g * per_group : (g + 1) * per_group].tolist())[-best_n:] for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -sum(sums[g]))[:topk_groups]
            for g in range(num_groups):
                if g not in best:
                    row[g * per_group : (g + 1) * per_group] = float("-inf")
        order = sorted(range(experts), key=lambda e: -row[e].item())[:top_k]
        ids[t] = torch.tensor(order)
        weights[t] = scores[t, order]
        if renormalize:
            weights[t] = weights[t] / weights[t].sum()
    return weights * scaling, ids


def ref_fused_moe(
    x: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: list[torch.Tensor] | None = None,
    down_bias: list[torch.Tensor] | None = None,
    product_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The mixture of experts in float64, token by token: ``sum_j w[t, j] * down_e(act(gate_up_e x))``.

    Args:
        x: ``[tokens, hidden]``.
        gate_up: per expert ``[2 * intermediate, hidden]`` (gate rows, then up rows).
        down: per expert ``[hidden, intermediate]``.
        topk_weights: ``[tokens, k]``.
        topk_ids: ``[tokens, k]`` expert ids.
        activation: ``"silu"`` (``silu(gate) * up``) or ``"swigluoai"`` (gpt-oss: ``(clamp(up, -7, 7) + 1) *
            g * sigmoid(1.702 g)`` with ``g = min(gate, 7)``).
        gate_up_bias: per expert ``[2 * intermediate]``, or None.
        down_bias: per expert ``[hidden]``, or None.
        product_dtype: round the gate/up product (bias included) and the activation to this dtype, as a
            backend that keeps its intermediates in the model dtype does: the clamped SwiGLU's products reach
            several times the clamp, where one bfloat16 rounding is more than the dtype's tolerance of the
            output. None keeps float64.
    """
    out = torch.zeros(x.shape, dtype=F64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            projected = ref_linear(x[t : t + 1].cpu(), gate_up[e].cpu())
            if gate_up_bias is not None:
                projected = projected + gate_up_bias[e].cpu().to(F64)
            if product_dtype is not None:
                projected = projected.to(product_dtype).to(F64)
            if activation == "silu":
                hidden = ref_silu_and_mul(projected)
            else:
                inter = projected.shape[-1] // 2
                gate, up = projected[..., :inter].clamp(max=7.0), projected[..., inter:].clamp(-7.0, 7.0)
                hidden = (up + 1.0) * gate / (1.0 + torch.exp(-1.702 * gate))
            if product_dtype is not None:
                hidden = hidden.to(product_dtype).to(F64)
            y = ref_linear(hidden, down[e].cpu())[0]
            if down_bias is not None:
                y = y + down_bias[e].cpu().to(F64)
            out[t] += float(topk_weights[t, j]) * y
    return out
