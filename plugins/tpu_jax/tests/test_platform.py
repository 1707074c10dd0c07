"""Detection, claims, validation and the backends' torch boundary of the ``tpu`` platform."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import CacheConfig, EngineConfig
from engine_plugin_sdk import KVCacheSpec
from engine_plugin_tpu.platform import (
    ALLOW_CPU_ENV,
    CPU_LABEL,
    TENSOR_PARALLEL_ENV,
    TpuPlatform,
    cpu_fallback_allowed,
)


def test_without_a_tpu_detect_explains_and_names_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_CPU_ENV, raising=False)
    result = TpuPlatform.detect()
    assert not result.available
    assert ALLOW_CPU_ENV in result.reason and ("libtpu" in result.reason or "TPU" in result.reason)


def test_the_cpu_switch_makes_it_available_with_a_loud_label() -> None:
    result = TpuPlatform.detect()
    assert result.available and result.reason == CPU_LABEL
    caps = TpuPlatform().capabilities()
    assert caps.extra["backend"] == CPU_LABEL
    # both attention kernels (jax.numpy and Pallas) honour causal=False; sinks they have not
    assert caps.non_causal_attention and not caps.attention_sinks
    assert cpu_fallback_allowed({ALLOW_CPU_ENV: "1"}) and not cpu_fallback_allowed({ALLOW_CPU_ENV: "0"})


def test_import_and_detect_load_no_jax() -> None:
    code = (
        "import sys, json; import engine_plugin_tpu.plugin as p; from engine_plugin_tpu.platform import TpuPlatform;"
        "r = TpuPlatform.detect(); print(json.dumps([r.available, 'jax' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    available, jax_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert available and not jax_loaded


def test_cli_without_the_switch_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != ALLOW_CPU_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "generate", "--device", "tpu", "hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode != 0
    assert "not available" in out.stderr and ALLOW_CPU_ENV in out.stderr


def test_validate_accepts_claims_and_rejects_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = TpuPlatform()
    assert platform.validate(EngineConfig(dtype="auto")) == []
    assert platform.validate(EngineConfig(dtype="float16"))
    assert platform.validate(EngineConfig(cache=CacheConfig(block_size=7)))
    monkeypatch.setenv(TENSOR_PARALLEL_ENV, "two")
    assert any(TENSOR_PARALLEL_ENV in r for r in platform.validate(EngineConfig()))


def test_backends_answer_torch_with_torch_and_update_torch_caches_in_place() -> None:
    platform = TpuPlatform()
    attention = platform.make_attention_backend()
    shape = attention.kv_cache_shape(8, 16, 2, 64)
    cache = torch.randn(shape)
    before = cache.clone()
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    returned = attention.write_kv(key, value, cache, torch.tensor([17, -1, 100]))
    assert returned is cache
    keys, values = attention.gather_kv(cache, list(range(8)))
    torch.testing.assert_close(keys[17], key[0], rtol=0, atol=0)
    torch.testing.assert_close(values[100], value[2], rtol=0, atol=0)
    changed = (cache != before).reshape(2, 2, -1, 64).any(-1).any(0).any(0).nonzero().flatten().tolist()
    assert changed == [17, 100]

    gemm = platform.make_gemm_backend()
    w = torch.randn(12, 32)
    out = gemm.linear(torch.randn(5, 32), gemm.prepare_weight(w, torch.float32))
    assert isinstance(out, torch.Tensor) and out.shape == (5, 12) and out.dtype == torch.float32


def test_block_cache_layers_are_replaceable_and_checked() -> None:
    platform = TpuPlatform()
    attention = platform.make_attention_backend()
    pool = platform.make_block_cache(KVCacheSpec(2, 2, 64, 16, torch.float32), 6, attention)
    layer = attention.write_kv(torch.ones(1, 2, 64), torch.ones(1, 2, 64), pool.kv_caches[1], torch.tensor([3]))
    pool.kv_caches[1] = layer
    assert float(np.asarray(pool.pool[1, 0, :, 0, 3]).min()) == 1.0
    assert float(np.abs(np.asarray(pool.pool[0])).max()) == 0.0
    with pytest.raises(ValueError, match="layer cache must have shape"):
        pool.kv_caches[0] = np.zeros((2, 2))
    with pytest.raises(ValueError, match="destination block appears more than once"):
        pool.copy_blocks([(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="source block ids must be in"):
        pool.swap_out([(9, 0)])


def test_jit_graph_capture_replays_and_falls_back_for_torch_code() -> None:
    import jax.numpy as jnp

    capture = TpuPlatform().make_graph_capture()
    rng = np.random.default_rng(0)

    def make_inputs(n: int) -> tuple:
        return jnp.asarray(rng.standard_normal((n, 8)), jnp.float32), jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)

    def step(x, w):
        return jnp.tanh(x @ w) + x.sum(-1, keepdims=True)

    capture.capture(step, [1, 2, 4], make_inputs)
    assert capture.captured_batch_sizes() == [1, 2, 4]
    for n in [1, 2, 4, 1, 3]:
        x, w = make_inputs(n)
        np.testing.assert_allclose(np.asarray(capture.run(n, x, w)), np.asarray(step(x, w)), rtol=1e-6, atol=1e-6)

    def torch_step(x, w):
        return torch.nn.functional.silu(x @ w)

    capture.capture(torch_step, [1, 2], lambda n: (torch.randn(n, 8), torch.randn(8, 8)))
    assert capture.captured_batch_sizes() == []
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    torch.testing.assert_close(capture.run(2, x, w), torch_step(x, w))
