"""The CPU plugin's heap tuning: glibc's mmap and trim thresholds raised once a process drives the CPU."""

from __future__ import annotations

import engine_plugin_cpu.heap as heap
from engine_plugin_cpu.platform import CpuPlatform


class FakeLibc:
    def __init__(self, accepts: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self.accepts = accepts

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accepts else 0


def test_the_thresholds_are_raised_through_mallopt() -> None:
    libc = FakeLibc()
    assert heap.tune_process_heap({}, lambda: libc)
    assert libc.calls == [(-3, heap.MMAP_THRESHOLD), (-1, heap.TRIM_THRESHOLD), (-2, heap.TOP_PAD)]
    assert heap.MMAP_THRESHOLD >= 256 << 20  # an embedding batch's or a prefill chunk's activations fit under it


def test_turned_off_refused_or_not_glibc_leaves_the_heap_alone() -> None:
    libc = FakeLibc()
    assert not heap.tune_process_heap({heap.TUNE_HEAP_ENV: "0"}, lambda: libc)
    assert libc.calls == []
    assert not heap.tune_process_heap({}, lambda: None)
    assert not heap.tune_process_heap({}, lambda: FakeLibc(accepts=False))


def test_this_process_has_glibc_and_accepts_the_settings() -> None:
    """CI and the project's machines run glibc: the real call must succeed there, not just the fake's."""
    assert heap._glibc() is not None
    assert heap.tune_process_heap({})


def test_driving_the_cpu_tunes_the_heap(monkeypatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(heap, "tune_process_heap", lambda: calls.append(True) or True)
    CpuPlatform().use_device(0)
    assert calls == [True]
