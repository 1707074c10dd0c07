"""Tensor parallelism over two virtual CPU devices gives the same logits and tokens as one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from engine_plugin_tpu.platform import ALLOW_CPU_ENV, TENSOR_PARALLEL_ENV

CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
from engine import LLM, SamplingParams
from test_runner import PROMPTS, prefill_logits

results = {{}}
for tp in ("1", "2"):
    os.environ[{tp_env!r}] = tp
    llm = LLM(model={folder!r}, device="tpu", dtype="float32", kv_cache_memory_bytes=8 << 20)
    engine = llm.llm_engine
    logits = prefill_logits(llm, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    results[tp] = (logits, tokens)
    if tp == "2":
        pool_devices = len(engine.block_cache.pool.sharding.device_set)
        wq = engine.model.params.layers.wq
        wq_shard = wq.addressable_shards[0].data.shape
print(json.dumps({{
    "max_diff": float((results["1"][0] - results["2"][0]).abs().max()),
    "same_tokens": results["1"][1] == results["2"][1],
    "pool_devices": pool_devices,
    "wq_shape": list(wq.shape),
    "wq_shard": list(wq_shard),
}}))
"""


def test_two_way_tensor_parallel_matches_one_device(tiny_llama) -> None:
    folder, _ = tiny_llama
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env[ALLOW_CPU_ENV] = "1"
    script = textwrap.dedent(CHILD).format(
        tests=str(Path(__file__).parent), folder=str(folder), tp_env=TENSOR_PARALLEL_ENV
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["pool_devices"] == 2
    # q projection [layers, hidden, heads * head_dim] split by output column: half the heads per device
    assert report["wq_shard"] == [*report["wq_shape"][:2], report["wq_shape"][2] // 2]
    assert report["max_diff"] < 1e-4
    assert report["same_tokens"]
