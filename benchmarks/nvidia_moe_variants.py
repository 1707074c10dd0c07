"""The A/B variants of ``nvidia_h200_moe.py decode``: an earlier commit's routing kernel, and other MoE tiles over
the backend's (``--moe-tiles-ab``, ``--down-gemv``, ``--down-prefetch``), each run in the same process; and (there
and in ``nvidia_h200.py decode``) the decode attention asking L2 for its layer's o_proj weight
(``ENGINE_BENCH_L2_AHEAD=1``) and a router for the next layer's q/k/v (``ENGINE_BENCH_L2_NEXT_QKV=1``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

#: set to 1 where a step is recorded: the decode attention asks L2 for the layer's o_proj weight (:func:`use_l2_ahead`)
L2_AHEAD_ENV = "ENGINE_BENCH_L2_AHEAD"
#: ... and the router's norm GEMV (a mixture of experts at batch 1) for the next layer's q/k/v weight
L2_NEXT_QKV_ENV = "ENGINE_BENCH_L2_NEXT_QKV"


def use_l2_ahead() -> None:
    """In this process, wherever ``ENGINE_BENCH_L2_AHEAD=1`` while a decode step is recorded, the fused decode
    attention kernel's programs ask the L2 cache for the layer's o_proj weight once past their wait
    (``launchers.paged_decode(l2_ahead=...)``): the bytes o_proj reads next, fetched while attention leaves the
    memory idle. A benchmark's hook, not the engine's: the weight reaches the launcher through the decoder layer's
    ``attend``. Settable per engine (``nvidia_h200_moe.py decode --env-ab ENGINE_BENCH_L2_AHEAD=0 ...=1``)."""
    import torch

    from engine.models.layers import blocks
    from engine_plugin_sdk.gpu.triton_kernels import launchers

    attend, decode = blocks.DecoderLayer.attend, launchers.paged_decode
    ahead: dict[str, Any] = {}

    def attend_asking_l2(self: Any, model: Any, call: Any, kv_cache: Any) -> Any:
        weight = getattr(self, "o_proj", None)
        wanted = os.environ.get(L2_AHEAD_ENV) == "1" and isinstance(weight, torch.Tensor) and weight.is_contiguous()
        ahead["weight"] = weight if wanted else None
        try:
            return attend(self, model, call, kv_cache)
        finally:
            ahead.clear()

    def decode_asking_l2(*args: Any, **kwargs: Any) -> Any:
        if ahead.get("weight") is not None and kwargs.get("new_kv") is not None:
            kwargs["l2_ahead"] = ahead["weight"]
        return decode(*args, **kwargs)

    blocks.DecoderLayer.attend = attend_asking_l2  # type: ignore[method-assign]
    launchers.paged_decode = decode_asking_l2  # type: ignore[assignment]
    use_l2_next_qkv()


def use_l2_next_qkv() -> None:
    """In this process, wherever ``ENGINE_BENCH_L2_NEXT_QKV=1`` while a step is recorded, a mixture of experts'
    router GEMV with the norm before it (batch 1) asks the L2 cache for the next layer's q/k/v weight past its wait
    (``gemv_launchers.add_rms_norm_gemv(l2_ahead=...)``): read after the experts' bytes, if it lasts in L2 that
    long (``nvidia_l2_window.py``'s ``ahead`` rows). A benchmark's hook, through the decoder layer's ``mlp``."""
    import torch

    from engine.models.layers import blocks
    from engine_plugin_sdk.gpu.triton_kernels import gemv_launchers

    mlp, router = blocks.DecoderLayer.mlp, gemv_launchers.add_rms_norm_gemv
    ahead: dict[str, Any] = {}

    def mlp_asking_l2(self: Any, model: Any, x: Any) -> Any:
        layers = model.layers
        after = {id(a): b for a, b in zip(layers, layers[1:], strict=False)}
        weight = getattr(after.get(id(self)), "qkv", None)
        wanted = os.environ.get(L2_NEXT_QKV_ENV) == "1" and isinstance(weight, torch.Tensor) and weight.is_contiguous()
        ahead["weight"] = weight if wanted else None
        try:
            return mlp(self, model, x)
        finally:
            ahead.clear()

    def router_asking_l2(*args: Any, **kwargs: Any) -> Any:
        if ahead.get("weight") is not None:
            kwargs["l2_ahead"] = ahead["weight"]
        return router(*args, **kwargs)

    blocks.DecoderLayer.mlp = mlp_asking_l2  # type: ignore[method-assign]
    gemv_launchers.add_rms_norm_gemv = router_asking_l2  # type: ignore[assignment]


def use_routing_kernel_from(path: str) -> None:
    """Launch the routing kernel (``moe_topk_kernel``) of ``path``, a kernel module of an earlier commit (e.g. ``git
    show 72926ed~1:plugin_sdk/engine_plugin_sdk/gpu/triton_kernels/moe_kernels.py``, before the packed-key picks),
    in this process: the A/B of a routing change. Launch options that kernel does not take are dropped."""
    import inspect
    import types

    from nvidia_h200 import load_module

    from engine_plugin_sdk.gpu.triton_kernels import moe_launchers

    kernel = load_module("routing_kernel_before", path).moe_topk_kernel
    taken = set(inspect.signature(kernel.fn).parameters)

    class Launch:
        def __getitem__(self, grid: Any) -> Any:
            launch = kernel[grid]
            options = {"num_warps", "num_stages", "launch_pdl"}
            return lambda *a, **kw: launch(*a, **{k: v for k, v in kw.items() if k in taken or k in options})

    moe_launchers.mrk = types.SimpleNamespace(moe_topk_kernel=Launch())  # type: ignore[attr-defined]


def with_tiles(run: Any, overrides: dict[str, Any]) -> Any:
    """``run`` (a fused-MoE launcher taking its tiles sixth) with ``overrides`` replacing fields of its tiles."""

    def launch(x: Any, gate_up: Any, down: Any, weights: Any, ids: Any, tiles: Any, *args: Any, **kw: Any) -> Any:
        return run(x, gate_up, down, weights, ids, dataclasses.replace(tiles, **overrides), *args, **kw)

    return launch


def parse_moe_tiles(spec: str) -> dict[str, Any]:
    """``default`` or ``field=value+field=value`` (``down_gemv=4x256x4+down_prefetch=0``) as MoeTiles overrides."""
    if spec == "default":
        return {}
    fields: dict[str, Any] = {}
    for item in spec.split("+"):
        key, value = item.split("=")
        fields[key] = tuple(int(v) for v in value.split("x")) if "x" in value else int(value)
    return fields
