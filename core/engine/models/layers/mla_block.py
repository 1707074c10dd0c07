"""Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form.

Per token the checkpoint's attention makes one compressed latent ``c`` (``kv_lora_rank`` wide, normalised)
and one rotary key ``k_pe`` shared by every head; head ``h``'s key is ``[W_UK[h] c, k_pe]`` and its value
``W_UV[h] c``. Since ``q_nope . (W_UK[h] c) = (W_UK[h]^T q_nope) . c``, each head's query is moved into the
latent space once, and attention becomes multi-query over rows ``[c, k_pe]`` (one KV head of
``kv_lora_rank + qk_rope_head_dim``, the model's ``head_dim``): the cache holds the latent rows, not
per-head keys and values. The value rows are ``[c, 0]``, so each head's output is its attention-weighted
latent, which ``W_UV[h]`` takes back to the value space. The softmax scale stays the checkpoint's
(``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale ** 2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.loader.lazy_tensor import materialize
from engine.loader.weight_slices import dense
from engine.models.layers.rope import RotaryEmbedding, interleaved_to_halves
from engine.models.layers.spec import MlaSpec

if TYPE_CHECKING:
    from engine.models.config import ModelConfig
    from engine.models.layers.decoder import DenseDecoder
    from engine.models.layers.layer_loader import LayerLoader


@dataclass(slots=True)
class MlaAttention:
    """One layer's latent attention.

    Attributes:
        spec: the widths.
        q_a: the query compression ``[q_lora_rank, hidden]``, None when the query is one projection.
        q_a_norm: its RMSNorm scale.
        q: ``[heads * (qk_nope + qk_rope), in]``: every head's non-rotary rows, then every head's rotary
            rows (NeoX halves).
        kv_a: ``[kv_lora_rank + qk_rope, hidden]``: the latent's rows, then the shared rotary key's.
        kv_a_norm: the latent's RMSNorm scale.
        k_absorb: ``[heads, qk_nope, kv_lora_rank]``: takes each head's query into the latent space.
        v_absorb: ``[heads, kv_lora_rank, v_head_dim]``: takes each head's output out of it.
        o_proj: ``[hidden, heads * v_head_dim]``.
    """

    spec: MlaSpec
    q_a: Any
    q_a_norm: torch.Tensor | None
    q: Any
    kv_a: Any
    kv_a_norm: torch.Tensor
    k_absorb: torch.Tensor
    v_absorb: torch.Tensor
    o_proj: Any

    def forward(
        self, model: DenseDecoder, x: Any, rotary: RotaryEmbedding, rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: Any, meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """Queries, the latent row and rotary key of each token, absorbed attention, the output projection."""
        gemm, ops, eps, s = model.gemm, model.ops, model.config.rms_norm_eps, self.spec
        tokens, heads, latent_width = x.shape[0], model.num_heads, s.kv_lora_rank
        q_in = x if self.q_a is None else ops.rms_norm(gemm.linear(x, self.q_a), self.q_a_norm, eps)
        q = gemm.linear(q_in, self.q)
        q_nope = q[:, : heads * s.qk_nope_head_dim].reshape(tokens, heads, s.qk_nope_head_dim)
        q_pe = q[:, heads * s.qk_nope_head_dim :].reshape(tokens, heads, s.qk_rope_head_dim)
        kv = gemm.linear(x, self.kv_a)
        latent = ops.rms_norm(kv[:, :latent_width].contiguous(), self.kv_a_norm, eps)
        k_pe = kv[:, latent_width:].reshape(tokens, 1, s.qk_rope_head_dim)
        q_pe, k_pe = rotary.apply(ops, rope[0], rope[1], q_pe, k_pe)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.k_absorb).transpose(0, 1)
        latent = latent.reshape(tokens, 1, latent_width)
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent, k_pe], dim=-1)
        value = torch.cat([latent, torch.zeros_like(k_pe)], dim=-1)
        attn = model.attention.forward(query, key, value, kv_cache, meta)
        out_latent = attn.reshape(tokens, heads, -1)[..., :latent_width]
        out = torch.bmm(out_latent.transpose(0, 1), self.v_absorb).transpose(0, 1)
        return gemm.linear(out.reshape(tokens, heads * s.v_head_dim), self.o_proj)


def mla_weight_shapes(spec: MlaSpec, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's tensors by HF name (``prefix`` is the layer's)."""
    hidden, heads, p = config.hidden_size, config.num_heads, prefix + "self_attn."
    q_rows = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (q_rows, hidden)
    else:
        shapes[p + "q_a_proj.weight"] = (spec.q_lora_rank, hidden)
        shapes[p + "q_a_layernorm.weight"] = (spec.q_lora_rank,)
        shapes[p + "q_b_proj.weight"] = (q_rows, spec.q_lora_rank)
    shapes[p + "kv_a_proj_with_mqa.weight"] = (spec.kv_lora_rank + spec.qk_rope_head_dim, hidden)
    shapes[p + "kv_a_layernorm.weight"] = (spec.kv_lora_rank,)
    if spec.split_kv_b:
        shapes[p + "k_b_proj.weight"] = (heads, spec.kv_lora_rank, spec.qk_nope_head_dim)
        shapes[p + "v_b_proj.weight"] = (heads, spec.v_head_dim, spec.kv_lora_rank)
    else:
        shapes[p + "kv_b_proj.weight"] = (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank)
    shapes[p + "o_proj.weight"] = (hidden, heads * spec.v_head_dim)
    return shapes


def load_mla(loader: LayerLoader, prefix: str, spec: MlaSpec) -> MlaAttention:
    """Take a layer's latent-attention tensors out of the checkpoint (``prefix`` is the layer's)."""
    model = loader.model
    cfg, shapes = model.config, mla_weight_shapes(spec, model.config, prefix)
    p, heads, rope = prefix + "self_attn.", cfg.num_heads, spec.qk_rope_head_dim
    nope, latent_width = spec.qk_nope_head_dim, spec.kv_lora_rank

    def take(name: str) -> torch.Tensor:
        return materialize(dense(loader.take(p + name + ".weight", shapes[p + name + ".weight"])))

    q_a = q_a_norm = None
    if spec.q_lora_rank is not None:
        q_a = loader.matrix(take("q_a_proj"))
        q_a_norm = loader.norm(p + "q_a_layernorm", spec.q_lora_rank)
    q = take("q_proj" if spec.q_lora_rank is None else "q_b_proj")
    per_head = q.reshape(heads, nope + rope, -1)
    q_pe = per_head[:, nope:].reshape(heads * rope, -1)
    kv_a = take("kv_a_proj_with_mqa")
    k_pe = kv_a[latent_width:]
    if spec.interleaved_rope:
        # the same reordering of both rotary parts leaves their dot products as they were
        q_pe, k_pe = interleaved_to_halves(q_pe, heads, rope, rope), interleaved_to_halves(k_pe, 1, rope, rope)
    if spec.split_kv_b:
        k_absorb, v_absorb = take("k_b_proj").transpose(1, 2), take("v_b_proj").transpose(1, 2)
    else:
        kv_b = take("kv_b_proj").reshape(heads, nope + spec.v_head_dim, latent_width)
        k_absorb, v_absorb = kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2)
    device, dtype = model.device, model.dtype
    return MlaAttention(
        spec=spec,
        q_a=q_a,
        q_a_norm=q_a_norm,
        q=loader.matrix(torch.cat([per_head[:, :nope].reshape(heads * nope, -1), q_pe])),
        kv_a=loader.matrix(torch.cat([kv_a[:latent_width], k_pe])),
        kv_a_norm=loader.norm(p + "kv_a_layernorm", latent_width),
        k_absorb=k_absorb.contiguous().to(device=device, dtype=dtype),
        v_absorb=v_absorb.contiguous().to(device=device, dtype=dtype),
        o_proj=loader.matrix(take("o_proj")),
    )
