"""The fused ops on the inputs a model really passes: strided views, fused rows and odd widths.

A model hands the ops views, not fresh tensors: q and k are column ranges of one fused qkv row, the
gate/up halves come out of one merged projection, norms run on slices of wider rows. A kernel that
assumes a contiguous input, or a power-of-two width, reads the wrong elements; one that writes a whole
row writes outside its view. So every op runs here on

- ``rows``: views whose rows are longer than their width, at a storage offset (a slice of a wider
  row; for the rotary embedding, q and k as neighbouring column ranges of one q/k/v row);
- ``columns``: views with a column stride of 2 (real strides, not a copy made contiguous);
- contiguous inputs of widths that are not powers of two (576, 896, 320, as small models have).

What lies outside each view must come back bit for bit.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.interfaces.ops import OP_NAMES, reference_ops
from engine.interfaces.platform import Capabilities, Platform
from engine_conformance.helpers import assert_equal, torch_dtype
from engine_conformance.op_checks import FP8, check_op_result, spaced_router_logits
from engine_plugin_sdk.reference_ops import (
    make_cos_sin_cache,
    ref_add_layer_norm,
    ref_apply_token_bitmask,
    ref_fused_add_rms_norm,
    ref_gelu_tanh_and_mul,
    ref_layer_norm,
    ref_moe_topk,
    ref_post_norm_add_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)

EPS = 1e-5
#: hidden sizes of real small models (SmolLM2-135M, Qwen2-0.5B, a 5-head toy): not powers of two
WIDTHS = (576, 896, 320)
#: where an op's width is not a hidden size: the router's, numbers of experts of real MoE models (Qwen2-MoE,
#: DeepSeek-V2, Kimi K2), none a power of two and one above 256
OP_WIDTHS = {"moe_topk": (60, 160, 384)}
#: a decode row, a few and more than a tile of rows
ROWS = (1, 7, 33)
#: the width the layout checks run at (not a power of two either)
LAYOUT_WIDTH = 320
LAYOUTS = ("rows", "columns")
HEAD_DIM = 64


@dataclass(slots=True)
class Views:
    """Makes strided views of fresh buffers and remembers what lies outside them."""

    layout: str
    dtype: torch.dtype
    device: Any
    gen: torch.Generator
    #: (buffer, bool mask of the bytes inside views, copy of the buffer before the call)
    buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def rand(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype or self.dtype)

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """``values [rows, width]`` as a view in this layout (contiguous for ``"contiguous"``)."""
        values = values.to(self.device)
        if self.layout == "contiguous":
            return values
        rows, width = values.shape
        if self.layout == "rows":
            # 5 garbage columns before the view, 11 after: an odd offset and a row stride of width + 16
            return self._view(values, (rows, width + 16), lambda b: b[:, 5 : 5 + width])
        return self._view(values, (rows, 2 * width), lambda b: b[:, 1::2])

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]`` and k ``[T, KVH, D]`` as views of one buffer (a q/k/v row in ``"rows"``)."""
        (t, h, d), kvh = q.shape, k.shape[1]
        q, k = q.to(self.device), k.to(self.device)
        if self.layout == "contiguous":
            return q, k
        if self.layout == "rows":
            # [q heads | k heads | v heads]; v stands for the values the op must leave alone
            buf = self._buffer((t, (h + 2 * kvh) * d))
            mask = torch.zeros(buf.shape, dtype=torch.bool)
            qv, kv = buf[:, : h * d].view(t, h, d), buf[:, h * d : (h + kvh) * d].view(t, kvh, d)
            mask[:, : (h + kvh) * d] = True
        else:
            buf = self._buffer((t, h + kvh, 2 * d))
            mask = torch.zeros(buf.shape, dtype=torch.bool)
            qv, kv = buf[:, :h, ::2], buf[:, h:, ::2]
            mask[:, :, ::2] = True
        qv.copy_(q)
        kv.copy_(k)
        self.buffers.append((buf, mask, buf.clone()))
        return qv, kv

    def _buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.rand(*shape, scale=30.0).to(self.device)

    def _view(
        self, values: torch.Tensor, shape: tuple[int, int], pick: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        buf = self._buffer(shape).to(values.dtype)
        mask = torch.zeros(shape, dtype=torch.bool)
        pick(mask).fill_(True)
        view = pick(buf)
        view.copy_(values)
        self.buffers.append((buf, mask, buf.clone()))
        return view

    def check_untouched(self, label: str) -> None:
        """Every byte outside the views is what it was before the call."""
        for buf, mask, before in self.buffers:
            assert_equal(buf.cpu()[~mask], before.cpu()[~mask], f"{label}: memory outside the input views")


def build_case(op_name: str, views: Views, width: int, rows: int) -> tuple[tuple, tuple]:
    """``(args, expected)`` for one op; ``width`` is the hidden size (the gate/up half for the GLUs, the
    vocabulary for the sampling ops, heads * 64 for the rotary embedding)."""
    rand, place = views.rand, views.place
    if op_name in ("rms_norm", "layer_norm"):
        x, w, b = (
            place(rand(rows, width) + (3.0 if op_name == "layer_norm" else 0.0)),
            rand(width),
            rand(width),
        )
        w, b = w.to(views.device), b.to(views.device)
        if op_name == "rms_norm":
            return (x, w, EPS), (ref_rms_norm(x, w, EPS),)
        return (x, w, b, EPS), (ref_layer_norm(x, w, b, EPS),)
    if op_name in ("fused_add_rms_norm", "fused_add_rms_norm_fp8"):
        x, residual, w = place(rand(rows, width)), place(rand(rows, width)), rand(width).to(views.device)
        extra = (FP8,) if op_name.endswith("fp8") else ()
        return (x, residual, w, EPS, *extra), ref_fused_add_rms_norm(x, residual, w, EPS)
    if op_name == "add_layer_norm":
        x, residual = place(rand(rows, width) + 3.0), place(rand(rows, width))
        w, b = rand(width).to(views.device), rand(width).to(views.device)
        return (x, residual, w, b, EPS), (ref_add_layer_norm(x, residual, w, b, EPS),)
    if op_name == "post_norm_add_rms_norm":
        x, residual = place(rand(rows, width, scale=20.0)), place(rand(rows, width))
        post_w, w = rand(width).to(views.device), rand(width).to(views.device)
        return (x, residual, post_w, w, EPS), ref_post_norm_add_rms_norm(x, residual, post_w, w, EPS)
    if op_name in ("silu_and_mul", "gelu_tanh_and_mul", "silu_and_mul_fp8"):
        x = place(rand(rows, 2 * width))
        ref = ref_gelu_tanh_and_mul if op_name.startswith("gelu") else ref_silu_and_mul
        extra = (FP8,) if op_name.endswith("fp8") else ()
        return (x, *extra), (ref(x),)
    if op_name == "rotary_embedding":
        heads = width // HEAD_DIM
        kv_heads = max(1, heads // 4)
        q, k = views.qk(rand(rows, heads, HEAD_DIM), rand(rows, kv_heads, HEAD_DIM))
        positions = torch.randint(0, 4096, (rows,), generator=views.gen).to(views.device)
        cache = make_cos_sin_cache(4096, HEAD_DIM).to(views.device)
        return (positions, q, k, cache), ref_rotary_embedding(positions, q, k, cache)
    if op_name == "greedy_pick":
        padded = width + 7
        logits = rand(rows, padded, scale=4.0, dtype=torch.float32)
        logits[:, width:] = 100.0  # padding past the vocabulary: never picked
        logits = place(logits)
        raw = torch.log_softmax(logits[:, :width].double().cpu(), dim=-1)
        ids = raw.argmax(dim=-1)
        return (logits, width), (ids, raw.gather(1, ids.unsqueeze(1)).squeeze(1))
    if op_name == "apply_token_bitmask":
        words = -(-width // 32)
        logits = place(rand(rows, width + 5, scale=4.0))
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=views.gen, dtype=torch.int32)
        indices = torch.arange(0, rows, 2)
        expected = ref_apply_token_bitmask(logits, bitmask, indices)
        return (logits, bitmask.to(views.device), indices.to(views.device)), (expected,)
    if op_name == "moe_topk":
        # width experts, 8 of them chosen per token
        logits = place(spaced_router_logits(views.gen, rows, width, 8).to(views.dtype))
        return (logits, 8, True), ref_moe_topk(logits, 8, True)
    raise ValueError(f"no test case for op {op_name!r}")


def run_case(
    platform: Platform, caps: Capabilities, op_name: str, layout: str, width: int, rows: int, label: str
) -> None:
    """Build, call and judge one op in every claimed dtype."""
    op = getattr(reference_ops().with_overrides(platform.op_overrides()), op_name)
    for dtype_name in caps.dtypes:
        dtype = torch_dtype(dtype_name)
        # a stable seed per case (str hashes change between runs)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{op_name} {layout} {width} {rows}".encode()))
        views = Views(layout, dtype, platform.torch_device(), gen)
        args, expected = build_case(op_name, views, width, rows)
        where = f"{label} {dtype_name} {layout} width {width} rows {rows}"
        # the views themselves, not clones: cloning a view with gaps makes it contiguous
        result = op(*args)
        check_op_result(op_name, result, expected, dtype, list(args), where)
        views.check_untouched(where)


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.capability("ops.{op_name}.strided")
def test_op_on_views(platform: Platform, caps: Capabilities, op_name: str) -> None:
    for layout in LAYOUTS:
        for rows in (1, 7):
            run_case(platform, caps, op_name, layout, LAYOUT_WIDTH, rows, f"ops.{op_name}.strided")


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.capability("ops.{op_name}.widths")
def test_op_widths(platform: Platform, caps: Capabilities, op_name: str) -> None:
    for width in OP_WIDTHS.get(op_name, WIDTHS):
        for rows in ROWS:
            run_case(platform, caps, op_name, "contiguous", width, rows, f"ops.{op_name}.widths")
