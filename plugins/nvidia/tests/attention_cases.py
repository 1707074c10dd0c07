"""The attention kernels' test cases shared by this plugin's kernel tests: batches of decodes and of mixed rows,
a problem with its cache filled, the tuning of the target, and the check against the float64 reference."""

from __future__ import annotations

import torch

from engine_plugin_sdk.gpu.triton_kernels import INTERPRETER_TUNING, KernelTuning, launchers
from engine_plugin_sdk.problems import make_attention_problem
from engine_plugin_sdk.tolerances import compare

DECODE_LENS = ([1, 1, 1, 1], [1, 15, 40, 97])
MIXED_LENS = ([5, 1, 16, 1, 9], [37, 50, 16, 3, 73])


def tuning() -> KernelTuning:
    return INTERPRETER_TUNING if not torch.cuda.is_available() else KernelTuning()


def filled_problem(device, dtype, lens, block_size=16, head_dim=64, heads=8, kv_heads=2, seed=0, **kw):
    problem = make_attention_problem(
        len(lens[0]), lens[0], lens[1], heads, kv_heads, head_dim, block_size, 64,
        dtype=dtype, device=device, seed=seed, **kw,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 100)
    cache = torch.randn((2, 64, block_size, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    launchers.write_kv(problem.prefix_key, problem.prefix_value, cache, problem.prefix_slot_mapping)
    launchers.write_kv(problem.key, problem.value, cache, problem.metadata.slot_mapping)
    return problem, cache


def check(out, problem, what):
    problem_text = compare(out, problem.reference_output(), problem.tolerance(), what)
    assert not problem_text, problem_text
