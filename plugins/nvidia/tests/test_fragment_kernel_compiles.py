"""The 4-bit fragment kernel compiled for the GPU on this machine (Triton's bundled ``ptxas``, no GPU needed):
its inline PTX assembles for Ampere and Hopper in bf16 and fp16, and the tensors handed to the asm have the
layout the PTX assumes (element ``i`` of ``[32 * warps, 4]`` on lane ``i % 32`` of warp ``i // 32``, four
consecutive registers a lane), and its words read ahead (``DEPTH``) are in flight before the first ``mma``.
The interpreter, which runs the kernel elsewhere in these tests, emulates the
``mma`` instead, so only a compile sees the asm and the layout Triton picks for it. The compile runs in a
process of its own: this test process has Triton in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("fragment_compile_probe.py")
GEMV_PROBE = Path(__file__).with_name("gemv_compile_probe.py")
DOT_PROBE = Path(__file__).with_name("dot_gemv_compile_probe.py")
#: runs several probes in one process
PROBES = Path(__file__).with_name("compile_probes.py")


def run_probe(probe: Path, *args: str) -> object:
    """What ``probe`` printed, run without ``TRITON_INTERPRET`` (skips where Triton has no ``ptxas``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(probe), *args], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def printed() -> dict:
    """What each of this module's probes printed, by its file name (the three run in one process: its start, with
    torch and Triton, took about as long as a probe's compiles)."""
    return run_probe(PROBES, *(probe.stem for probe in (PROBE, GEMV_PROBE, DOT_PROBE)))


def test_fragment_asm_assembles_with_the_layout_it_assumes(printed: dict) -> None:
    results = printed[PROBE.stem]
    assert len(results) == 8
    for case in results:
        # per word two products and (blocks of 128 columns or more) two activation sums, four words a chunk
        assert case["mma"] >= (16 if case["case"][7] >= 128 else 8), case
        assert case["asm_ops"] >= 1 and case["layouts"] == [case["expected"]], case
        # words read DEPTH iterations ahead: two loads a chunk (rows g and g + 8) issued before the loop (a
        # read-ahead written in Triton that ptxas sank into the loop would leave only the first chunk's)
        depth, ahead, _, prefetch = case["case"][3:7]
        assert case["loads_before_loop"] == 2 * depth + (4 if ahead else 0), case
        # the L2 asks of PREFETCH iterations past the read-ahead: two a chunk (rows g and g + 8) before the loop,
        # and two an iteration inside it unless those before covered every chunk (112 of 8 warps: 14 iterations)
        covered = depth + prefetch >= 14
        assert case["prefetches_before_loop"] == 2 * min(prefetch, 14 - depth), case
        assert case["prefetches_in_loop"] == (0 if covered or not prefetch else 2), case


def test_gemv_loops_pipeline_only_when_asked(printed: dict) -> None:
    """The word GEMV's and the byte GEMV's reduction loops past their first tile: plain (``LOOP_STAGES=1``, no
    ``cp.async``: the launch's ``num_stages`` does not reach a loop without a ``tl.dot``) and pipelined by
    Triton when ``GroupedIntTiles.gemv_loop_stages`` asks (copies ahead through shared memory)."""
    copies = printed[GEMV_PROBE.stem]
    assert copies["word 1"] == 0 and copies["byte 1"] == 0, copies
    assert copies["word 3"] > 0 and copies["byte 3"] > 0, copies
    assert copies["word gated 1"] == 0 and copies["word gated 3"] > 0, copies
    assert copies["byte gated 1"] == 0 and copies["byte gated 3"] > 0, copies


def test_six_bit_dot_gemv_hands_its_asm_the_plane_as_two_registers(printed: dict) -> None:
    """Over 6-bit codes the integer-dot GEMV reads a block's plane as one 8-byte load beside its 16-byte words, and
    its asm takes the plane's four int16 halves as two 32-bit registers after the four words (``$8`` = ``A``,
    ``$9`` = ``B``, as :func:`_dot6_asm` reads them); no layout shuffle through shared memory beyond the 8-bit
    kernel's (the plane in a thread's own registers, as its words)."""
    cases = {(case["bits"], case["in_features"]): case for case in printed[DOT_PROBE.stem]}
    for width in (4096, 14336):
        six, eight = cases[6, width], cases[8, width]
        assert six["operands"] == ["i32"] * 4 + ["<2 x i16>"] * 2 + ["i32"] * 16, six
        assert eight["operands"] == ["i32"] * 12, eight
        assert "v2.b32" in six["loads"] and "v4.b32" in six["loads"], six
        assert six["shared"] <= eight["shared"], (six, eight)
