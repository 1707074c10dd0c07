"""Tensor parallelism with ``jax.sharding``: one mesh axis ``"tp"``, Megatron-style weight splits.

Design (GSPMD does the communication; no hand-written collectives):

- q/k/v and gate/up projections are split by output columns (attention heads, MLP channels), so each
  chip computes its own heads and its own slice of the MLP.
- o_proj and down_proj are split by input rows; their partial products are summed across chips by an
  all-reduce that XLA inserts where the replicated hidden state is needed.
- The KV pool is split by kv head (axis 2 of ``[layers, 2, kv_heads, blocks, block_size, dim]``), so
  every chip stores and attends over only its heads; block tables and slot mappings are replicated.
- Embeddings, norms, the LM head and the step inputs are replicated (a vocab-parallel LM head is a
  later optimisation).

The requirement is that ``num_kv_heads`` (hence ``num_heads``) and ``intermediate_size`` divide by the
tensor-parallel size. Tested on virtual CPU devices (``--xla_force_host_platform_device_count``); not
run on a multi-chip TPU slice yet.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine_plugin_sdk.models import ModelConfig
from engine_plugin_tpu.model import LayerParams, LlamaParams

AXIS = "tp"


def check_tensor_parallel(config: ModelConfig, tp: int, num_devices: int) -> list[str]:
    """Reasons the model cannot be split ``tp`` ways here; empty if it can."""
    reasons = []
    if tp < 1:
        reasons.append(f"tensor-parallel size must be at least 1, got {tp}")
        return reasons
    if tp > num_devices:
        reasons.append(f"tensor-parallel size {tp} exceeds the {num_devices} JAX device(s) present")
    if config.num_kv_heads % tp:
        reasons.append(f"{config.num_kv_heads} kv heads do not divide by tensor-parallel size {tp}")
    if config.intermediate_size % tp:
        reasons.append(f"intermediate size {config.intermediate_size} does not divide by tensor-parallel size {tp}")
    return reasons


def make_mesh(tp: int) -> Mesh:
    """A one-axis mesh over the first ``tp`` devices."""
    return Mesh(jax.devices()[:tp], (AXIS,))


def param_specs() -> LlamaParams:
    """The PartitionSpec of every parameter (stacked layer weights carry a leading, unsplit layer axis)."""
    column, row, vector, replicated_vec = P(None, None, AXIS), P(None, AXIS, None), P(None, AXIS), P(None, None)
    layers = LayerParams(
        input_norm=replicated_vec,
        wq=column,
        wk=column,
        wv=column,
        bq=vector,
        bk=vector,
        bv=vector,
        wo=row,
        bo=replicated_vec,
        post_norm=replicated_vec,
        w_gate=column,
        w_up=column,
        w_down=row,
    )
    return LlamaParams(embed=P(), layers=layers, final_norm=P(), lm_head=P(), cos_sin=P())


def pool_spec() -> P:
    """The KV pool splits by kv head."""
    return P(None, None, AXIS)


def shard_params(params: LlamaParams, mesh: Mesh) -> LlamaParams:
    """Place every parameter on the mesh according to :func:`param_specs`."""
    specs = param_specs()
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        params,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def replicated(mesh: Mesh) -> Any:
    """The sharding of step inputs and outputs: a full copy on every device."""
    return NamedSharding(mesh, P())
