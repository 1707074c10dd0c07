"""Loading one decoder layer's weights from a checkpoint's tensors into a :class:`DecoderLayer`: norms in
their applied form, fused projections (rows of this rank's heads under tensor parallelism), MoE and latent
attention blocks, prepared by the GEMM backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.interfaces.gemm import QuantizedWeight
from engine.loader.lazy_tensor import materialize
from engine.loader.quantized import concat_weights, stacks_quantized
from engine.loader.weight_slices import dense, weight_columns, weight_rows
from engine.models.layers.blocks import DecoderLayer
from engine.models.layers.mla_block import load_mla
from engine.models.layers.moe_block import load_moe
from engine.models.layers.names import gate_up_names, qk_norm_shapes, qkv_names
from engine.models.layers.rope import interleaved_to_halves
from engine.models.layers.row_blocks import RowBlocks
from engine.models.layers.spec import LayerSpec
from engine.models.weights import take_tensor

if TYPE_CHECKING:
    from engine.models.layers.decoder import DenseDecoder


def contiguous(weight: Any) -> Any:
    """A tensor made contiguous (a column slice is a strided view); a quantized weight unchanged."""
    return weight.contiguous() if isinstance(weight, torch.Tensor) else weight


class LayerLoader:
    """Takes one model's tensors out of the checkpoint dict into :class:`DecoderLayer` objects.

    Args:
        model: the model being loaded (its spec, sizes, GEMM backend, dtype and device).
        tensors: HF name -> tensor; taken tensors are removed.
    """

    def __init__(self, model: DenseDecoder, tensors: dict[str, Any]) -> None:
        self.model = model
        self.tensors = tensors

    def take(self, name: str, shape: tuple[int, ...], lazy_ok: bool = False) -> Any:
        """Remove and return a tensor, checking its shape; read from its file now unless ``lazy_ok`` (a
        tensor-parallel rank's projections are sliced first, so that only its slice is read)."""
        tensor = take_tensor(self.tensors, name, shape)
        return tensor if lazy_ok else materialize(tensor)

    def norm(self, name: str, size: int) -> torch.Tensor:
        """A norm scale in its applied form (``1 + w`` for Gemma's norms); its bias is :meth:`norm_bias`'s."""
        m = self.model
        weight = self.take(name + ".weight", (size,))
        if m.spec.gemma_norms:
            weight = 1.0 + weight.float()
        return weight.to(device=m.device, dtype=m.dtype)

    def norm_bias(self, name: str, size: int) -> torch.Tensor | None:
        """A LayerNorm's bias, None where the spec's norms have none."""
        m = self.model
        if m.spec.norm != "layer" or not m.spec.norm_bias:
            return None
        return self.take(name + ".bias", (size,)).to(device=m.device, dtype=m.dtype)

    def _qk_norms(self, p: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        m, spec, cfg = self.model, self.model.spec, self.model.config
        if spec.qk_norm == "none":
            return None, None
        if spec.qk_norm != "each_head":
            full = spec.qk_norm == "full"
            q_name, k_name = spec.qk_norm_names
            return self.norm(p + q_name, m.q_size if full else cfg.head_dim), self.norm(p + k_name, m.kv_size if full else cfg.head_dim)
        scales = []
        for shapes, heads in zip(qk_norm_shapes(spec, cfg), (cfg.num_heads, cfg.num_kv_heads)):
            weight = torch.stack([self.take(p + name, shape) for name, shape in shapes.items()]).reshape(heads, cfg.head_dim)
            rope = spec.ropes[0] if spec.ropes else None
            if rope is not None and rope.interleaved:
                # the scales follow the Q/K rows into the halves layout
                weight = interleaved_to_halves(weight.reshape(-1), heads, cfg.head_dim, rope.rotary_dim).view(heads, cfg.head_dim)
            scales.append(weight.to(device=m.device, dtype=m.dtype))
        if m.tp is not None:
            (q_first, q_count), (kv_first, kv_count) = m.tp.heads(cfg.num_heads), m.tp.kv_heads(cfg.num_kv_heads)
            scales = [scales[0][q_first : q_first + q_count], scales[1][kv_first : kv_first + kv_count]]
        return scales[0], scales[1]

    def matrix(self, t: torch.Tensor | QuantizedWeight, projection: bool = True) -> Any:
        """A matrix prepared by the GEMM backend (quantized at load for layer projections when asked)."""
        m = self.model
        # a quantized weight goes to the GEMM backend as the loader found it: packing is the backend's job
        if isinstance(t, QuantizedWeight):
            return m.gemm.prepare_weight(t, m.dtype)
        t = t.to(m.device)
        if projection and m.linear_quantizer is not None:
            return m.gemm.prepare_weight(m.linear_quantizer(t), m.dtype)
        return m.gemm.prepare_weight(t, m.dtype)

    def fused_matrix(self, parts: list[torch.Tensor | QuantizedWeight]) -> Any:
        """Row blocks prepared as one matrix when they stack; quantized parts of different schemes that
        the backend keeps packed stay apart rather than dequantized to stack: joined by the backend where it runs
        them as one product (:meth:`GemmBackend.join_row_blocks`), else as :class:`RowBlocks`."""
        quantized = [w for w in parts if isinstance(w, QuantizedWeight)]
        kept = self.model.gemm.supported_quant_schemes
        if len(parts) > 1 and quantized and not stacks_quantized(parts) and all(w.scheme in kept for w in quantized):
            # neighbours that stack stay one block (Q4_K_M's q and k), so a block is one product
            runs: list[list[torch.Tensor | QuantizedWeight]] = [[parts[0]]]
            for w in parts[1:]:
                if stacks_quantized([*runs[-1], w]):
                    runs[-1].append(w)
                else:
                    runs.append([w])
            rows = tuple(sum(w.shape[0] for w in run) for run in runs)
            prepared = tuple(self.matrix(concat_weights(run)) for run in runs)
            # the backend may run the blocks' products as one (a weight it takes as the stacked projection)
            joined = self.model.gemm.join_row_blocks(prepared, rows)
            return joined if joined is not None else RowBlocks(prepared, rows)
        return self.matrix(concat_weights(parts))

    def _qkv(self, p: str) -> tuple[Any, torch.Tensor | None]:
        m, spec, cfg = self.model, self.model.spec, self.model.config
        h = cfg.hidden_size
        sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        rope = spec.ropes[0] if spec.ropes else None
        interleaved = rope is not None and rope.interleaved
        # a rank reads only its heads' rows, unless the rows must be reordered whole first
        lazy = m.tp is not None and not interleaved
        if spec.fused_qkv:
            weights = [self.take(p + spec.fused_qkv + ".weight", (sum(sizes), h), lazy)]
            biases = [self.take(p + spec.fused_qkv + ".bias", (sum(sizes),), lazy)] if spec.qkv_bias else []
        else:
            names = qkv_names(spec)
            weights = [self.take(p + n + ".weight", (s, h), lazy) for n, s in zip(names, sizes)]
            biases = [self.take(p + n + ".bias", (s,), lazy) for n, s in zip(names, sizes)] if spec.qkv_bias else []
        if interleaved:
            assert rope is not None
            if m.tp is not None:  # rows are reordered whole: a rank's quantized rows would not stay quantized
                weights = [dense(w) for w in weights]
            weights, biases = self._to_halves(weights, rope.rotary_dim), self._to_halves(biases, rope.rotary_dim)
        if m.tp is not None:
            weights = [materialize(w) for w in self._own_heads(weights, sizes)]
            biases = [materialize(b) for b in self._own_heads(biases, sizes)]
        bias = torch.cat(biases).to(device=m.device, dtype=m.dtype) if biases else None
        return self.fused_matrix(weights), bias

    def _own_heads(self, parts: list[torch.Tensor], sizes: tuple[int, int, int]) -> list[torch.Tensor]:
        """The rows of this rank's query and KV heads out of q, k and v (or of one fused tensor)."""
        if not parts:
            return parts
        m, cfg = self.model, self.model.config
        assert m.tp is not None
        (q_first, q_count), (kv_first, kv_count) = m.tp.heads(cfg.num_heads), m.tp.kv_heads(cfg.num_kv_heads)
        d = cfg.head_dim
        # each part's own rows, or the same rows at the q, k and v offsets of one fused tensor
        q, k, v = parts if len(parts) == 3 else parts * 3
        bases = (0, 0, 0) if len(parts) == 3 else (0, sizes[0], sizes[0] + sizes[1])
        firsts, counts = (q_first, kv_first, kv_first), (q_count, kv_count, kv_count)
        return [
            weight_rows(part, slice(base + first * d, base + (first + count) * d))
            for part, base, first, count in zip((q, k, v), bases, firsts, counts)
        ]

    def _to_halves(self, parts: list[torch.Tensor], rotary_dim: int) -> list[torch.Tensor]:
        if not parts:
            return parts
        cfg = self.model.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = parts if len(parts) == 3 else parts[0].split([q_size, kv_size, kv_size])
        q = interleaved_to_halves(q, cfg.num_heads, cfg.head_dim, rotary_dim)
        k = interleaved_to_halves(k, cfg.num_kv_heads, cfg.head_dim, rotary_dim)
        return [q, k, v]

    def layer(self, p: str, layer_spec: LayerSpec) -> DecoderLayer:
        """Load layer ``p`` (its HF name prefix).

        Raises:
            ValueError: a tensor is missing or misshapen.
        """
        m, spec, cfg = self.model, self.model.spec, self.model.config
        h, names = cfg.hidden_size, spec.norms

        def norm(name: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return (self.norm(p + name, h), self.norm_bias(p + name, h)) if name else (None, None)

        pre_attn, pre_attn_bias = norm(names.pre_attn)
        if spec.mla is not None:
            mla = load_mla(self, p, spec.mla)
            qkv = qkv_bias = q_norm = k_norm = o_proj = o_bias = None
        else:
            mla = None
            qkv, qkv_bias = self._qkv(p)
            q_norm, k_norm = self._qk_norms(p)
            o_proj, o_bias = self._o_proj(p)
        (post_attn, post_attn_bias), (pre_mlp, pre_mlp_bias) = norm(names.post_attn), norm(names.pre_mlp)
        moe = None
        if layer_spec.moe:
            assert spec.moe is not None
            moe, gate_up, down = load_moe(self, p, spec.moe), None, None
        else:
            gate_up, down = self._dense_mlp(p)
        post_mlp, post_mlp_bias = norm(names.post_mlp)
        layer = DecoderLayer(
            pre_attn=pre_attn,
            qkv=qkv,
            qkv_bias=qkv_bias,
            q_norm=q_norm,
            k_norm=k_norm,
            o_proj=o_proj,
            o_bias=o_bias,
            post_attn=post_attn,
            pre_mlp=pre_mlp,
            gate_up=gate_up,
            down=down,
            post_mlp=post_mlp,
            window=layer_spec.sliding_window,
            rope=layer_spec.rope,
            pre_attn_bias=pre_attn_bias,
            post_attn_bias=post_attn_bias,
            pre_mlp_bias=pre_mlp_bias,
            post_mlp_bias=post_mlp_bias,
            moe=moe,
            mla=mla,
        )
        if spec.attention_sinks:
            sinks = self.take(p + "self_attn.sinks", (cfg.num_heads,))
            if m.tp is not None:
                first, count = m.tp.heads(cfg.num_heads)
                sinks = sinks[first : first + count]
            layer.sinks = sinks.to(device=m.device, dtype=torch.float32)
        if spec.qk_norm == "each_head":
            layer.head_ones = torch.ones(cfg.head_dim, device=m.device, dtype=m.dtype)
        # FP8 producers only where a norm or activation that has one feeds the GEMM (pre-RMSNorms, SwiGLU)
        rms = spec.norm == "rms"
        if names.pre_attn and rms:
            layer.qkv_fp8 = m.gemm.row_quantized_input(layer.qkv)
        if moe is not None:
            return layer  # the experts take plain activations
        if names.pre_mlp and rms and not spec.parallel:
            layer.gate_up_fp8 = m.gemm.row_quantized_input(layer.gate_up)
        if spec.activation == "silu":
            layer.down_fp8 = m.gemm.row_quantized_input(layer.down)
        return layer

    def _o_proj(self, p: str) -> tuple[Any, torch.Tensor | None]:
        """Layer ``p``'s output projection and bias (this rank's head columns under tensor parallelism)."""
        m, spec, cfg = self.model, self.model.spec, self.model.config
        h = cfg.hidden_size
        o_weight = self.take(p + "self_attn.o_proj.weight", (h, cfg.num_heads * cfg.head_dim), lazy_ok=m.tp is not None)
        o_bias = self.take(p + "self_attn.o_proj.bias", (h,)).to(device=m.device, dtype=m.dtype) if spec.o_bias else None
        if m.tp is not None:
            first, count = m.tp.heads(cfg.num_heads)
            o_weight = contiguous(materialize(weight_columns(o_weight, slice(first * cfg.head_dim, (first + count) * cfg.head_dim))))
            o_bias = o_bias if m.tp.rank == 0 else None  # added once to the ranks' sum
        return self.matrix(o_weight), o_bias

    def _dense_mlp(self, p: str) -> tuple[Any, Any]:
        """Layer ``p``'s gated MLP: its fused gate/up and its down projection, prepared (this rank's
        columns of the one and rows of the other under tensor parallelism)."""
        m, spec, cfg = self.model, self.model.spec, self.model.config
        h, inter = cfg.hidden_size, cfg.intermediate_size
        lazy = m.tp is not None
        if spec.fused_gate_up:
            fused = self.take(p + spec.fused_gate_up + ".weight", (2 * inter, h), lazy)
            parts = [fused] if m.tp is None else [weight_rows(fused, slice(0, inter)), weight_rows(fused, slice(inter, 2 * inter))]
        else:
            parts = [self.take(p + n + ".weight", (inter, h), lazy) for n in gate_up_names(spec)]
        down = self.take(p + "mlp.down_proj.weight", (h, inter), lazy)
        if m.tp is not None:
            own = m.tp.rows(inter)
            parts = [materialize(weight_rows(part, own)) for part in parts]
            down = contiguous(materialize(weight_columns(down, own)))
        return self.fused_matrix(parts), self.matrix(down)
