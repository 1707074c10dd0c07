"""Which modules of a decoder adapters may target, and how they fold into the model's fused projections.

A dense decoder layer runs four projections: q/k/v (one fused matrix), the output projection, gate/up
(fused) and down. An adapter's update of ``q_proj`` becomes rows of the fused q/k/v update: its ``A``
takes the first rank-sized band of the fused ``A`` and its ``B`` the q rows of the first band of columns
of a block-diagonal ``B`` (see :mod:`engine.interfaces.lora`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.lora.peft_adapter import LoraAdapter, LoraLoadError
from engine.models.layers.names import gate_up_names, qkv_names

#: the layer projections, in the order a layer runs them
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True, slots=True)
class TargetPart:
    """One module inside a layer projection.

    Attributes:
        projection: which of :data:`PROJECTIONS` it belongs to.
        band: its index among the projection's modules (its rank band in the fused ``A``).
        rows: its first output row in the fused projection, and how many it has.
        in_features: its input width.
    """

    projection: str
    band: int
    rows: tuple[int, int]
    in_features: int


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """The targetable modules of a model: module path -> (layer, part), and each projection's shape.

    Attributes:
        parts: ``model.layers.{i}.self_attn.q_proj`` etc. -> (layer index, :class:`TargetPart`).
        shapes: projection -> (bands, out_features, in_features), the same for every layer (for the
            model-level ``embed`` and ``lm_head`` too).
        interleaved_rope: GLM's rotary layout (Q/K rows are permuted at load; adapters' ``B`` rows too):
            (heads, kv heads, head_dim, rotary_dim), or None.
    """

    parts: dict[str, tuple[int, TargetPart]]
    shapes: dict[str, tuple[int, int, int]]
    interleaved_rope: tuple[int, int, int, int] | None = None


def decoder_targets(model: Any) -> LoraTargets:
    """The targets of a :class:`~engine.models.layers.decoder.DenseDecoder`: its layers' projections (not
    a mixture of experts' or latent attention's) and the embeddings and lm_head."""
    spec, cfg = model.spec, model.config
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
    qkv = qkv_names(spec)
    qkv_rows = [(0, q_size + 2 * kv_size)] if len(qkv) == 1 else [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)]
    gate_up = gate_up_names(spec)
    gate_up_rows = [(0, 2 * inter)] if len(gate_up) == 1 else [(0, inter), (inter, inter)]
    layout = [
        *((name, TargetPart("qkv", i, rows, hidden)) for i, (name, rows) in enumerate(zip(qkv, qkv_rows))),
        ("self_attn.o_proj", TargetPart("o", 0, (0, hidden), q_size)),
        *((name, TargetPart("gate_up", i, rows, hidden)) for i, (name, rows) in enumerate(zip(gate_up, gate_up_rows))),
        ("mlp.down_proj", TargetPart("down", 0, (0, hidden), inter)),
    ]
    parts: dict[str, tuple[int, TargetPart]] = {}
    for i, layer_spec in enumerate(spec.layers):
        prefix = model.hf_layer_prefix.format(i)
        for name, part in layout:
            if spec.mla is not None and part.projection in ("qkv", "o"):
                continue
            if layer_spec.moe and part.projection in ("gate_up", "down"):
                continue
            parts[prefix + name] = (i, part)
    # the model-level targets (layer -1): the token embeddings (PEFT's lora_embedding_A/B) and the lm_head
    parts["model.embed_tokens"] = (-1, TargetPart("embed", 0, (0, hidden), cfg.vocab_size))
    parts["lm_head"] = (-1, TargetPart("lm_head", 0, (0, cfg.vocab_size), hidden))
    shapes = {
        "qkv": (len(qkv), q_size + 2 * kv_size, hidden),
        "o": (1, hidden, q_size),
        "gate_up": (len(gate_up), 2 * inter, hidden),
        "down": (1, hidden, inter),
        "embed": (1, hidden, cfg.vocab_size),
        "lm_head": (1, cfg.vocab_size, hidden),
    }
    rope = spec.ropes[0] if spec.ropes else None
    interleaved = (cfg.num_heads, cfg.num_kv_heads, hd, rope.rotary_dim) if rope is not None and rope.interleaved else None
    return LoraTargets(parts, shapes, interleaved)


def check_adapter(adapter: LoraAdapter, targets: LoraTargets, max_rank: int) -> None:
    """Refuse an adapter this model cannot run, in one line.

    Raises:
        LoraLoadError: a module the model lacks (or LoRA cannot target here), a shape that is not the
            module's, or a rank above ``max_rank``.
    """
    name = adapter.request.lora_name
    if adapter.rank > max_rank:
        raise LoraLoadError(f"LoRA adapter {name!r} has rank {adapter.rank}, above max_lora_rank={max_rank}")
    for module, shape in adapter.base_layers.items():
        found = targets.parts.get(module)
        expected = None if found is None else (found[1].rows[1], found[1].in_features)
        if found is not None and found[1].projection == "embed":
            expected = (found[1].in_features, found[1].rows[1])  # the embedding table is [vocab, hidden]
        if found is None or shape != expected:
            # a resized vocabulary or a fully trained layer: the adapter would need more than its update
            raise LoraLoadError(f"LoRA adapter {name!r} carries a base weight for {module} of shape {shape}; adapters that replace base weights are not supported")
    for module, update in adapter.modules.items():
        found = targets.parts.get(module)
        if found is None:
            short = module.rsplit(".", 1)[-1]
            raise LoraLoadError(f"LoRA adapter {name!r} targets {module}; this engine runs adapters on the layers' q/k/v, o, gate/up and down projections, the embeddings and the lm_head only (not {short})")
        _, part = found
        expected_b = (part.rows[1], update.rank)
        if tuple(update.a.shape) != (update.rank, part.in_features) or tuple(update.b.shape) != expected_b:
            raise LoraLoadError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(update.a.shape)} and lora_B {tuple(update.b.shape)}; "
                f"this model's module needs [r, {part.in_features}] and [{part.rows[1]}, r]"
            )
