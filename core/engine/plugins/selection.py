"""Chooses the platform for ``--device``: ``auto`` picks the best available one."""

from __future__ import annotations

from engine.interfaces.platform import Platform
from engine.plugins.manager import PluginManager

#: where to get the official plugin for each well-known device name (an install hint, nothing more)
KNOWN_DEVICE_PACKAGES = {
    "cpu": "engine-plugin-cpu",
    "cuda": "engine-plugin-nvidia",
    "rocm": "engine-plugin-amd",
    "tpu": "engine-plugin-tpu",
    "npu": "engine-plugin-ascend",
}


class DeviceNotAvailableError(RuntimeError):
    """The requested device cannot be used; the message lists what can."""


def _matches(cls: type[Platform], device: str, plugin_name: str) -> bool:
    return device in (cls.name, plugin_name, *cls.aliases)


def select_platform(device: str, manager: PluginManager | None = None) -> Platform:
    """Instantiate the platform for ``device``.

    Args:
        device: ``"auto"``, a device name (``"cpu"``, ``"cuda"``, ...), an alias, or a plugin name.
        manager: the plugin manager; a fresh one reading entry points if None.

    Returns:
        The platform instance.

    Raises:
        DeviceNotAvailableError: no plugin provides ``device``, or it is present but unavailable here,
            with the available devices and an install hint in the message.
    """
    manager = manager or PluginManager()
    detected = manager.detect_all()
    available = [(r, c) for r, c, d in detected if d.available]
    available_names = sorted({c.name for _, c in available})
    listing = ", ".join(available_names) if available_names else "none"
    if device == "auto":
        if not available:
            raise DeviceNotAvailableError(
                "no device is available: no installed plugin detected its hardware. "
                f"{_plugin_problems(manager)}Install one, e.g. pip install engine-plugin-cpu"
            )
        record, cls = max(available, key=lambda rc: rc[1].priority)
        return cls()
    for record, cls, result in detected:
        if _matches(cls, device, record.name):
            if not result.available:
                raise DeviceNotAvailableError(
                    f"device {device!r} (plugin {record.name}) is not available: {result.reason}. "
                    f"Available devices: {listing}"
                )
            return cls()
    for record in manager.records:
        if record.status != "loaded" and (record.name == device or device in record.name):
            raise DeviceNotAvailableError(
                f"device {device!r}: plugin {record.name} could not be loaded: {record.error}. "
                f"Available devices: {listing}"
            )
    hint = KNOWN_DEVICE_PACKAGES.get(device)
    install = f"; install its plugin with: pip install {hint}" if hint else ""
    raise DeviceNotAvailableError(
        f"no installed plugin provides device {device!r}{install}. Available devices: {listing}"
    )


def _plugin_problems(manager: PluginManager) -> str:
    broken = [f"{r.name}: {r.error}" for r in manager.records if r.status != "loaded"]
    return ("Plugins that failed to load: " + "; ".join(broken) + ". ") if broken else ""
