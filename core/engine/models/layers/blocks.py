"""One decoder layer: its weights as loaded, and its forward pass (norms, attention block, gated MLP).

The layer reads the model's ops, GEMM, attention backend and spec; it never calls a kernel directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.interfaces.attention import AttentionMetadata, RotaryInput
from engine.interfaces.gemm import QuantizedWeight
from engine.loader.lazy_tensor import materialize
from engine.loader.quantized import concat_weights, stacks_quantized
from engine.loader.weight_slices import dense, weight_columns, weight_rows
from engine.models.layers.mla_block import MlaAttention, load_mla
from engine.models.layers.moe_block import MoeMLP, load_moe
from engine.models.layers.names import gate_up_names, qk_norm_shapes, qkv_names
from engine.models.layers.rope import interleaved_to_halves
from engine.models.layers.row_blocks import RowBlocks
from engine.models.layers.spec import LayerSpec
from engine.models.weights import take_tensor

if TYPE_CHECKING:
    from engine.models.layers.decoder import DenseDecoder


@dataclass(slots=True)
class DecoderLayer:
    """The loaded weights of one layer (norm scales already in their applied form) and its options."""

    pre_attn: torch.Tensor | None
    qkv: Any
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Any
    o_bias: torch.Tensor | None
    post_attn: torch.Tensor | None
    pre_mlp: torch.Tensor | None
    gate_up: Any
    down: Any
    post_mlp: torch.Tensor | None
    window: int | None
    rope: int | None
    #: the FP8 dtype each projection takes its input pre-quantized in (GemmBackend.row_quantized_input)
    qkv_fp8: Any = None
    gate_up_fp8: Any = None
    down_fp8: Any = None
    #: LayerNorm biases (StableLM), None for RMSNorm or a LayerNorm without one
    pre_attn_bias: torch.Tensor | None = None
    post_attn_bias: torch.Tensor | None = None
    pre_mlp_bias: torch.Tensor | None = None
    post_mlp_bias: torch.Tensor | None = None
    #: ones of ``head_dim``: ``each_head`` q/k norms normalise with it and then apply their per-head scales
    head_ones: torch.Tensor | None = None
    #: the layer's mixture of experts in place of ``gate_up`` / ``down`` (None: a dense MLP)
    moe: MoeMLP | None = None
    #: latent attention in place of ``qkv`` / ``o_proj`` (DeepSeek; None: the usual attention)
    mla: MlaAttention | None = None
    #: float32 ``[heads]`` attention sinks of this rank's heads (gpt-oss), None without
    sinks: torch.Tensor | None = None
    #: the adapter slots of this layer's projections (``engine.lora.slots.LayerLora``), None without LoRA
    lora: Any = None

    def _project(self, model: DenseDecoder, x: Any, weight: Any, bias: torch.Tensor | None, projection: str) -> torch.Tensor:
        # the base product, plus each row's adapter update where the step has adapter rows
        y = weight.linear(model.gemm, x, bias) if isinstance(weight, RowBlocks) else model.gemm.linear(x, weight, bias)
        if model.lora_plan is not None and self.lora is not None:
            slots = getattr(self.lora, projection)
            if slots is not None:
                model.gemm.add_lora(y, x, slots, model.lora_plan)
        return y

    def _norm_in(
        self,
        model: DenseDecoder,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        fp8: Any,
        bias: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor]:
        # add the branch to the residual stream and normalise it for the next block
        ops, eps = model.ops, model.config.rms_norm_eps
        if model.spec.norm == "layer":
            # no fused add for LayerNorm: its models (StableLM, Cohere) are not the ones served at scale
            summed = hidden if residual is None else hidden + residual
            return (summed if weight is None else ops.layer_norm(summed, weight, bias, eps)), summed
        if weight is None:
            # post-norm only (OLMo2): the block reads the stream itself
            summed = hidden if residual is None else hidden + residual
            return summed, summed
        if residual is None:
            return ops.rms_norm(hidden, weight, eps), hidden
        if fp8 is not None:
            # the norm writes the W8A8 GEMM's FP8 input itself: one pass over the activations fewer
            return ops.fused_add_rms_norm_fp8(hidden, residual, weight, eps, fp8)
        return ops.fused_add_rms_norm(hidden, residual, weight, eps)

    def _branch_out(
        self, model: DenseDecoder, out: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if weight is not None:
            out = model.norm(out, weight, bias)
        if model.spec.residual_multiplier is not None:
            out = out * model.spec.residual_multiplier
        return out

    def attention(
        self, model: DenseDecoder, x: Any, tables: list[tuple[torch.Tensor, torch.Tensor]], kv_cache: Any, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The attention block: fused projection, optional q/k norm and rotary, paged attention, output."""
        if self.mla is not None:
            assert self.rope is not None
            return self.mla.forward(model, x, model.rotaries[self.rope], tables[self.rope], kv_cache, meta)
        cfg, ops, eps = model.config, model.ops, model.config.rms_norm_eps
        qkv = self._project(model, x, self.qkv, self.qkv_bias, "qkv")
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([model.q_size, model.kv_size, model.kv_size], dim=-1)
        if model.spec.qk_norm == "full":
            q, k = ops.rms_norm(q, self.q_norm, eps), ops.rms_norm(k, self.k_norm, eps)
        heads, kv_heads = model.num_heads, model.num_kv_heads  # this rank's, under tensor parallelism
        q = q.reshape(num_tokens, heads, cfg.head_dim)
        k = k.reshape(num_tokens, kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, kv_heads, cfg.head_dim)
        if model.spec.qk_norm == "head":
            q = ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, eps).view(num_tokens, heads, cfg.head_dim)
            k = ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, eps).view(num_tokens, kv_heads, cfg.head_dim)
        elif model.spec.qk_norm == "each_head":
            # the norm ops take one scale for every row, so normalise with ones and scale per head after
            q = model.norm(q.reshape(-1, cfg.head_dim), self.head_ones).view_as(q) * self.q_norm
            k = model.norm(k.reshape(-1, cfg.head_dim), self.head_ones).view_as(k) * self.k_norm
        rotary = None
        if self.rope is not None:
            index, table = tables[self.rope]
            if model.attention.fuses_rotary and model.rotaries[self.rope].rotary_dim == cfg.head_dim:
                rotary = RotaryInput(index, table)
            else:
                q, k = model.rotaries[self.rope].apply(ops, index, table, q, k)
        if self.sinks is not None:
            # the copy shares the step's extras, so a backend's per-step plan is still built once
            meta = dataclasses.replace(meta, sinks=self.sinks)
        if rotary is not None:
            attn = model.attention.forward_rotary(q, k, v, kv_cache, meta, rotary)
        else:
            attn = model.attention.forward(q, k, v, kv_cache, meta)
        out = self._project(model, attn.reshape(num_tokens, model.q_size), self.o_proj, self.o_bias, "o")
        return out if model.tp is None else model.tp.reduce(out)

    def mlp(self, model: DenseDecoder, x: Any) -> torch.Tensor:
        """The gated MLP: fused gate/up, SwiGLU or GeGLU, down (summed over the tensor-parallel ranks);
        or the layer's mixture of experts."""
        if self.moe is not None:
            return self.moe.forward(model, x)
        if self._fused_gate_up(model):
            act = model.gemm.gated_linear(x, self.gate_up, model.spec.activation)
            out = self._project(model, act, self.down, None, "down")
            return out if model.tp is None else model.tp.reduce(out)
        gate_up = self._project(model, x, self.gate_up, None, "gate_up")
        if model.spec.activation == "gelu_tanh":
            out = self._project(model, model.ops.gelu_tanh_and_mul(gate_up), self.down, None, "down")
        elif self.down_fp8 is not None:
            out = self._project(model, model.ops.silu_and_mul_fp8(gate_up, self.down_fp8), self.down, None, "down")
        else:
            out = self._project(model, model.ops.silu_and_mul(gate_up), self.down, None, "down")
        return out if model.tp is None else model.tp.reduce(out)

    def _fused_gate_up(self, model: DenseDecoder) -> bool:
        # the backend fuses the activation into the gate/up product unless an adapter adds to that
        # product first, or the W8A8 down projection takes the activation's FP8 output
        if model.spec.activation not in model.gemm.gated_activations or self.down_fp8 is not None:
            return False
        if isinstance(self.gate_up, RowBlocks):
            return False
        return model.lora_plan is None or self.lora is None or self.lora.gate_up is None

    def forward(
        self,
        model: DenseDecoder,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: Any,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: returns the layer's last branch output and the residual stream it is added to."""
        x, residual = self._norm_in(model, hidden, residual, self.pre_attn, self.qkv_fp8, self.pre_attn_bias)
        hidden = self._branch_out(model, self.attention(model, x, tables, kv_cache, meta), self.post_attn, self.post_attn_bias)
        if model.spec.parallel:
            # both branches read the one norm's output; their sum is the layer's branch
            return hidden + self._branch_out(model, self.mlp(model, x), self.post_mlp, self.post_mlp_bias), residual
        x, residual = self._norm_in(model, hidden, residual, self.pre_mlp, self.gate_up_fp8, self.pre_mlp_bias)
        return self._branch_out(model, self.mlp(model, x), self.post_mlp, self.post_mlp_bias), residual


    def forward_post_normed(
        self,
        model: DenseDecoder,
        branch: torch.Tensor,
        residual: torch.Tensor | None,
        pending_post: torch.Tensor | None,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: Any,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a model with pre- and post-norms around both branches (Gemma 2/3, GLM4), each
        post-norm fused with its residual add and the next pre-norm (``post_norm_add_rms_norm``).

        Args:
            branch: the previous layer's MLP output before its post-norm (the embeddings for layer 0).
            residual: the residual stream, None for layer 0.
            pending_post: the previous layer's post-MLP norm scale, None for layer 0.

        Returns:
            This layer's MLP output before its post-norm (``self.post_mlp``), and the residual stream.
        """
        ops, eps = model.ops, model.config.rms_norm_eps
        if residual is None:
            x, residual = ops.rms_norm(branch, self.pre_attn, eps), branch
        else:
            x, residual = ops.post_norm_add_rms_norm(branch, residual, pending_post, self.pre_attn, eps)
        attn = self.attention(model, x, tables, kv_cache, meta)
        x, residual = ops.post_norm_add_rms_norm(attn, residual, self.post_attn, self.pre_mlp, eps)
        return self.mlp(model, x), residual


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
        the backend keeps packed stay apart (:class:`RowBlocks`) rather than dequantized to stack."""
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
            return RowBlocks(tuple(self.matrix(concat_weights(run)) for run in runs))
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
