"""The contract around the kernels: API version, cheap import and detection, honest claims, validate()."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import importlib_metadata
import pytest

from engine.config import SUPPORTED_DTYPES, CacheConfig, EngineConfig
from engine.interfaces import AttentionBackend, BlockCache, GemmBackend, GraphCapture
from engine.interfaces.ops import OP_NAMES
from engine.interfaces.platform import Capabilities, Platform
from engine.plugins.manager import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, check_api_compatibility
from engine_conformance.helpers import torch_dtype
from engine_conformance.pytest_plugin import PlatformTarget

#: libraries that must not load when a plugin module is imported (they belong inside hooks and methods)
HEAVY_VENDOR_MODULES = ("triton", "jax", "jaxlib", "torch_npu", "tensorflow", "flash_attn", "flashinfer")


def plugin_module_name(target: PlatformTarget) -> str:
    """The module a plugin's hooks live in: its entry point's module, or the module registered in-process."""
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == target.record.name:
            return ep.module
    return target.record.name


@pytest.mark.capability("contract.api_version")
def test_api_version_declared(platform_target: PlatformTarget) -> None:
    spec = platform_target.record.api_spec
    assert spec, (
        f"contract.api_version: plugin {platform_target.record.name!r} does not declare ENGINE_PLUGIN_API"
    )
    problem = check_api_compatibility(platform_target.record.name, spec)
    assert not problem, f"contract.api_version: {problem}"
    assert PLUGIN_API_VERSION, "the core declares its plugin API version"


CHILD_SCRIPT = """
import importlib, json, sys
module_name, platform_name, heavy = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
report = {}
importlib.import_module(module_name)
report["heavy_after_import"] = sorted(m for m in heavy if m in sys.modules)
def cuda_initialised():
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())
report["cuda_after_import"] = cuda_initialised()
from engine.plugins.manager import PluginManager
manager = PluginManager(load_entry_points=False)
record = manager.register_module(module_name)
classes = [c for c in record.platforms if c.name == platform_name]
if not classes:
    report["error"] = f"module {module_name} registered no platform named {platform_name!r}: {record.error}"
else:
    result = classes[0].detect()
    report["detect"] = [bool(result.available), result.reason]
    report["cuda_after_detect"] = cuda_initialised()
    jax = sys.modules.get("jax")
    backends = getattr(getattr(getattr(jax, "_src", None), "xla_bridge", None), "_backends", None)
    report["jax_backends_after_detect"] = sorted(backends) if backends else []
print("CONTRACT-REPORT " + json.dumps(report))
"""


@pytest.mark.capability("contract.cheap_import_and_detect")
def test_import_and_detect_are_cheap(platform_target: PlatformTarget) -> None:
    module = plugin_module_name(platform_target)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(CHILD_SCRIPT),
            module,
            platform_target.name,
            ",".join(HEAVY_VENDOR_MODULES),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CONTRACT-REPORT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.fail(
            f"contract.cheap_import_and_detect: importing {module} in a fresh process failed: {tail}",
            pytrace=False,
        )
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("CONTRACT-REPORT "))
    assert "error" not in report, f"contract.cheap_import_and_detect: {report.get('error')}"
    assert not report["heavy_after_import"], (
        f"contract.cheap_import_and_detect: importing {module} loaded {report['heavy_after_import']}; "
        "import vendor libraries inside hooks or platform methods"
    )
    assert not report["cuda_after_import"], (
        f"contract.cheap_import_and_detect: importing {module} initialised CUDA"
    )
    assert not report["cuda_after_detect"], "contract.cheap_import_and_detect: detect() initialised CUDA"
    assert not report["jax_backends_after_detect"], (
        f"contract.cheap_import_and_detect: detect() initialised JAX backends {report['jax_backends_after_detect']}"
    )


@pytest.mark.capability("contract.capabilities")
def test_capabilities_are_well_formed(platform: Platform, caps: Capabilities) -> None:
    assert isinstance(caps, Capabilities), "contract.capabilities: capabilities() must return Capabilities"
    assert caps.dtypes, "contract.capabilities: no dtype claimed"
    for name in (*caps.dtypes, *caps.kv_cache_dtypes):
        torch_dtype(name)
    assert caps.block_sizes and all(isinstance(b, int) and b > 0 for b in caps.block_sizes), (
        f"contract.capabilities: block sizes must be positive ints, got {caps.block_sizes}"
    )
    assert caps.head_sizes and all(isinstance(h, int) and h > 0 for h in caps.head_sizes), (
        f"contract.capabilities: head sizes must be positive ints, got {caps.head_sizes}"
    )
    unknown_ops = sorted(set(platform.op_overrides()) - set(OP_NAMES))
    assert not unknown_ops, f"contract.capabilities: op_overrides names unknown ops {unknown_ops}"


@pytest.mark.capability("contract.factories")
def test_factories_return_the_interfaces(platform: Platform, caps: Capabilities) -> None:
    attention = platform.make_attention_backend()
    assert isinstance(attention, AttentionBackend), "contract.factories: make_attention_backend()"
    assert isinstance(platform.make_gemm_backend(), GemmBackend), "contract.factories: make_gemm_backend()"
    assert isinstance(platform.make_graph_capture(), GraphCapture), "contract.factories: make_graph_capture()"
    from engine.interfaces.block_cache import KVCacheSpec

    spec = KVCacheSpec(1, 1, min(caps.head_sizes), caps.block_sizes[0], torch_dtype(caps.kv_cache_dtypes[0]))
    assert isinstance(platform.make_block_cache(spec, 4, attention), BlockCache), (
        "contract.factories: make_block_cache()"
    )
    assert platform.total_memory_bytes() > 0, "contract.factories: total_memory_bytes() must be positive"
    assert 0 <= platform.free_memory_bytes() <= platform.total_memory_bytes(), (
        "contract.factories: free_memory_bytes() must lie in [0, total_memory_bytes()]"
    )


@pytest.mark.capability("contract.validate")
def test_validate_accepts_claims_and_rejects_the_rest(platform: Platform, caps: Capabilities) -> None:
    claimed = EngineConfig(dtype=caps.dtypes[0], cache=CacheConfig(block_size=caps.block_sizes[0]))
    reasons = platform.validate(claimed)
    assert reasons == [], (
        f"contract.validate: rejects its own claims ({caps.dtypes[0]}, block {caps.block_sizes[0]}): {reasons}"
    )
    unclaimed: list[tuple[str, EngineConfig]] = []
    other_dtypes = [d for d in SUPPORTED_DTYPES if d != "auto" and d not in caps.dtypes]
    if other_dtypes:
        unclaimed.append((f"dtype {other_dtypes[0]}", EngineConfig(dtype=other_dtypes[0])))
    odd_block = next(b for b in (7, 13, 3, 5, 1000) if b not in caps.block_sizes)
    unclaimed.append(
        (
            f"block size {odd_block}",
            EngineConfig(dtype=caps.dtypes[0], cache=CacheConfig(block_size=odd_block)),
        )
    )
    kv_other = next(d for d in ("float8_e5m2", "float16", "float64") if d not in caps.kv_cache_dtypes)
    unclaimed.append(
        (
            f"KV cache dtype {kv_other}",
            EngineConfig(
                dtype=caps.dtypes[0],
                cache=CacheConfig(block_size=caps.block_sizes[0], kv_cache_dtype=kv_other),
            ),
        )
    )
    for what, config in unclaimed:
        reasons = platform.validate(config)
        assert reasons, f"contract.validate: accepts the unclaimed {what}"
        assert all(isinstance(r, str) and r.strip() for r in reasons), (
            f"contract.validate: reasons must be non-empty strings, got {reasons!r}"
        )
