"""The A/B variants of ``nvidia_h200_moe.py decode``: an earlier commit's routing kernel, and other MoE tiles over
the backend's (``--moe-tiles-ab``, ``--down-gemv``, ``--down-prefetch``), each run in the same process."""

from __future__ import annotations

import dataclasses
from typing import Any


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
