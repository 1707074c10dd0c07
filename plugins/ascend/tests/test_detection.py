"""Discovery and detection of the Ascend plugin, simulated at its boundary (torch_npu import, device count)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine import DeviceNotAvailableError, PluginManager, select_platform
from engine_plugin_ascend import kernel_switch, plugin, runtime
from engine_plugin_ascend.platform import AscendPlatform


@pytest.fixture(autouse=True)
def npu_kernels_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Detection tests describe the production switch setting unless they say otherwise."""
    monkeypatch.delenv(kernel_switch.KERNELS_ENV, raising=False)


class CountingNpu:
    """A stand-in for ``torch_npu.npu`` that records every attribute asked of it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> object:
        self.asked.append(name)
        if name == "device_count":
            return lambda: self.count
        raise AssertionError(f"detection touched torch_npu.npu.{name}")


def fake_host(monkeypatch: pytest.MonkeyPatch, installed: bool, nodes: list[str], npu: object) -> None:
    monkeypatch.setattr(runtime, "torch_npu_installed", lambda: installed)
    monkeypatch.setattr(runtime, "npu_device_nodes", lambda: nodes)
    monkeypatch.setattr(runtime, "import_torch_npu", lambda: SimpleNamespace(npu=npu))


def test_entry_point_discovery() -> None:
    records = {r.name: r for r in PluginManager().records}
    assert "ascend" in records, f"entry point not found: {list(records)}"
    record = records["ascend"]
    assert record.status == "loaded", record.error
    assert record.distribution == "engine-plugin-ascend"
    assert record.platforms == [AscendPlatform]
    assert record.api_spec == plugin.ENGINE_PLUGIN_API


def test_plugin_import_loads_no_vendor_or_backend_module() -> None:
    code = (
        "import sys, engine_plugin_ascend.plugin; "
        "print(sorted(m for m in sys.modules if m == 'torch_npu' or "
        "(m.startswith('engine_plugin_ascend.') and m != 'engine_plugin_ascend.plugin')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_torch_npu_the_reason_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = CountingNpu(1)
    fake_host(monkeypatch, installed=False, nodes=["/dev/davinci0"], npu=npu)
    result = AscendPlatform.detect()
    assert not result.available
    assert "torch_npu is not installed" in result.reason and "CANN" in result.reason
    assert npu.asked == [], "torch_npu must not be imported when it is absent"


def test_without_device_nodes_the_reason_names_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, installed=True, nodes=[], npu=CountingNpu(1))
    result = AscendPlatform.detect()
    assert not result.available and "/dev/davinci" in result.reason and "driver" in result.reason


def test_a_failing_torch_npu_import_is_reported_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, installed=True, nodes=["/dev/davinci0"], npu=CountingNpu(1))

    def broken() -> object:
        raise OSError("libascendcl.so: cannot open shared object file\nsecond line")

    monkeypatch.setattr(runtime, "import_torch_npu", broken)
    result = AscendPlatform.detect()
    assert not result.available
    assert "libascendcl.so" in result.reason and "set_env.sh" in result.reason and "\n" not in result.reason


def test_no_visible_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, installed=True, nodes=["/dev/davinci0"], npu=CountingNpu(0))
    result = AscendPlatform.detect()
    assert not result.available and "ASCEND_RT_VISIBLE_DEVICES" in result.reason


def test_an_npu_is_detected_by_counting_only(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = CountingNpu(8)
    fake_host(monkeypatch, installed=True, nodes=["/dev/davinci0", "/dev/davinci1"], npu=npu)
    result = AscendPlatform.detect()
    assert result.available and result.reason == ""
    # counting is all detection does: no set_device, no memory query, no stream
    assert npu.asked == ["device_count"]


def test_this_host_has_no_npu() -> None:
    result = AscendPlatform.detect()
    assert not result.available and result.reason


def test_select_platform_explains_why_npu_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, installed=False, nodes=[], npu=CountingNpu(0))
    with pytest.raises(DeviceNotAvailableError, match="torch_npu is not installed"):
        select_platform("npu", PluginManager(allow=["ascend", "cpu"]))
    with pytest.raises(DeviceNotAvailableError, match="torch_npu is not installed"):
        select_platform("ascend", PluginManager(allow=["ascend"]))


def test_auto_prefers_an_npu_over_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, installed=True, nodes=["/dev/davinci0"], npu=CountingNpu(1))
    assert isinstance(select_platform("auto", PluginManager(allow=["ascend", "cpu"])), AscendPlatform)


def test_a_bad_kernel_switch_makes_the_platform_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_switch.KERNELS_ENV, "fast")
    result = AscendPlatform.detect()
    assert not result.available and "ENGINE_ASCEND_KERNELS='fast'" in result.reason


def test_the_reference_switch_makes_it_available_and_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel_switch.KERNELS_ENV, "reference")
    assert AscendPlatform.detect().available
    platform = AscendPlatform()
    assert "testing only" in platform.capabilities().extra["kernels"]
    assert platform.torch_device().type == "cpu"


def test_plugins_list_shows_the_reason() -> None:
    env = {k: v for k, v in os.environ.items() if k != kernel_switch.KERNELS_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "plugins", "list"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    line = next((row for row in proc.stdout.splitlines() if row.startswith("ascend ")), "")
    assert "engine-plugin-ascend" in line and " npu " in line, proc.stdout
    assert "unavailable: torch_npu is not installed" in line
