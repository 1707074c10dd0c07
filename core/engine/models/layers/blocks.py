"""One decoder layer: its weights as loaded, and its forward pass (norms, attention block, gated MLP).
Loading them is :mod:`engine.models.layers.layer_loader`'s.

The layer reads the model's ops, GEMM, attention backend and spec; it never calls a kernel directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.interfaces.attention import AttentionMetadata, HeadNorm, RotaryInput
from engine.models.layers.mla_block import MlaAttention
from engine.models.layers.moe_block import MoeMLP
from engine.models.layers.row_blocks import RowBlocks

if TYPE_CHECKING:
    from engine.models.layers.decoder import DenseDecoder


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One layer's attention inputs, ready for the backend (:meth:`DecoderLayer.attend`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    #: the rotation the backend applies itself (None: the query and key arrive rotated)
    rotary: RotaryInput | None
    meta: AttentionMetadata

    def tensors(self) -> list[torch.Tensor]:
        """The step's tensors the backend reads (the ones another lane must wait for)."""
        return [self.query, self.key, self.value]


@dataclass(slots=True)
class PendingNorm:
    """A layer's residual add and RMS norm left to the product that reads them
    (:meth:`GemmBackend.add_rms_norm_linear`): that product sets :attr:`summed`, the new residual stream."""

    hidden: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    summed: torch.Tensor | None = None

    def linear(self, model: DenseDecoder, weight: Any, bias: torch.Tensor | None, activation: str | None = None) -> Any:
        out, self.summed = model.gemm.add_rms_norm_linear(
            self.hidden, self.residual, self.weight, self.eps, weight, bias, activation
        )
        return out

    def route(self, model: DenseDecoder, router: Any, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture of experts' router logits and the normalised rows its experts read
        (:meth:`GemmBackend.add_rms_norm_router`)."""
        logits, normed, self.summed = model.gemm.add_rms_norm_router(
            self.hidden, self.residual, self.weight, self.eps, router, bias
        )
        return logits, normed


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
        if isinstance(x, PendingNorm):
            return x.linear(model, weight, bias)  # only where nothing else reads the input (_norm_fuses)
        y = weight.linear(model.gemm, x, bias) if isinstance(weight, RowBlocks) else model.gemm.linear(x, weight, bias)
        slots = self._lora_slots(model, projection)
        if slots is not None:
            model.gemm.add_lora(y, x, slots, model.lora_plan)
        return y

    def _lora_slots(self, model: DenseDecoder, projection: str) -> Any:
        # the projection's adapter slots where the step has adapter rows, else None
        if model.lora_plan is None or self.lora is None:
            return None
        return getattr(self.lora, projection)

    def _qkv_pieces(self, model: DenseDecoder, x: Any) -> list[torch.Tensor]:
        sizes = [model.q_size, model.kv_size, model.kv_size]
        if isinstance(self.qkv, RowBlocks) and self._lora_slots(model, "qkv") is None:
            # q, k and v as views of their blocks' products (Q4_K_M's q/k and v): no concatenation
            return self.qkv.split_linear(model.gemm, x, sizes, self.qkv_bias)
        return list(self._project(model, x, self.qkv, self.qkv_bias, "qkv").split(sizes, dim=-1))

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
        call = self.attention_inputs(model, x, tables, meta)
        return self.attention_output(model, self.attend(model, call, kv_cache))

    def attention_inputs(
        self, model: DenseDecoder, x: Any, tables: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
    ) -> AttentionCall:
        """The attention block up to the backend: the fused projection, q/k norms and the rotary (or its
        table, where the backend rotates)."""
        cfg, ops, eps = model.config, model.ops, model.config.rms_norm_eps
        q, k, v = self._qkv_pieces(model, x)
        num_tokens = q.shape[0]
        if model.spec.qk_norm == "full":
            q, k = ops.rms_norm(q, self.q_norm, eps), ops.rms_norm(k, self.k_norm, eps)
        heads, kv_heads = model.num_heads, model.num_kv_heads  # this rank's, under tensor parallelism
        q = q.reshape(num_tokens, heads, cfg.head_dim)
        k = k.reshape(num_tokens, kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, kv_heads, cfg.head_dim)
        fuse_rotary = (
            self.rope is not None
            and model.attention.fuses_rotary
            and model.rotaries[self.rope].rotary_dim == cfg.head_dim
        )
        head_norm = None
        if model.spec.qk_norm == "head":
            if fuse_rotary and model.attention.fuses_head_norm:
                # the backend normalises each head on its way to rotating it (two launches fewer)
                head_norm = HeadNorm(self.q_norm, self.k_norm, eps)
            else:
                q = ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, eps).view(num_tokens, heads, cfg.head_dim)
                k = ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, eps).view(num_tokens, kv_heads, cfg.head_dim)
        elif model.spec.qk_norm == "each_head":
            # the norm ops take one scale for every row, so normalise with ones and scale per head after
            q = model.norm(q.reshape(-1, cfg.head_dim), self.head_ones).view_as(q) * self.q_norm
            k = model.norm(k.reshape(-1, cfg.head_dim), self.head_ones).view_as(k) * self.k_norm
        rotary = None
        if self.rope is not None:
            index, table = tables[self.rope]
            if fuse_rotary:
                rotary = RotaryInput(index, table, head_norm)
            else:
                q, k = model.rotaries[self.rope].apply(ops, index, table, q, k)
        if self.sinks is not None:
            # the copy shares the step's extras, so a backend's per-step plan is still built once
            meta = dataclasses.replace(meta, sinks=self.sinks)
        return AttentionCall(q, k, v, rotary, meta)

    def attend(self, model: DenseDecoder, call: AttentionCall, kv_cache: Any) -> torch.Tensor:
        """The backend's paged attention (which writes the new keys and values first)."""
        if call.rotary is not None:
            return model.attention.forward_rotary(call.query, call.key, call.value, kv_cache, call.meta, call.rotary)
        return model.attention.forward(call.query, call.key, call.value, kv_cache, call.meta)

    def attention_output(self, model: DenseDecoder, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of the backend's ``[tokens, heads, head_dim]`` result (summed over the
        tensor-parallel ranks)."""
        out = self._project(model, attn.reshape(attn.shape[0], model.q_size), self.o_proj, self.o_bias, "o")
        return out if model.tp is None else model.tp.reduce(out)

    def mlp(self, model: DenseDecoder, x: Any) -> torch.Tensor:
        """The gated MLP: fused gate/up, SwiGLU or GeGLU, down (summed over the tensor-parallel ranks);
        or the layer's mixture of experts."""
        if self.moe is not None:
            return self.moe.forward(model, x)
        if self._fused_gate_up(model):
            if isinstance(x, PendingNorm):
                act = x.linear(model, self.gate_up, None, model.spec.activation)
            else:
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
        return self._lora_slots(model, "gate_up") is None

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
        if residual is not None and self.mla is None and self._norm_fuses(model, self.pre_attn, self.qkv_fp8, self.qkv):
            pending = PendingNorm(hidden, residual, self.pre_attn, model.config.rms_norm_eps)
            attn_out = self.attention(model, pending, tables, kv_cache, meta)
            assert pending.summed is not None, "the q/k/v product sets the residual stream"
            return self.finish(model, pending, attn_out, pending.summed, fuse=True)
        x, residual = self.attention_norm(model, hidden, residual)
        return self.finish(model, x, self.attention(model, x, tables, kv_cache, meta), residual, fuse=True)

    def _norm_fuses(
        self, model: DenseDecoder, weight: torch.Tensor | None, fp8: Any, product: Any, claimed: bool | None = None
    ) -> bool:
        """Whether the residual add and RMS norm before ``product`` go into that product where the backend claims it
        (``claimed``, by default :attr:`GemmBackend.fuses_residual_norm`): the product must be the only reader of the
        norm's output (one weight, no adapter, no parallel branches; the callers rule out latent attention), or hand
        the output on (a router's, :meth:`_mlp_norm_fuses`)."""
        return (
            (model.gemm.fuses_residual_norm if claimed is None else claimed)
            and model.spec.norm != "layer"
            and not model.spec.parallel
            and weight is not None
            and fp8 is None
            and self.lora is None
            and not isinstance(product, RowBlocks)
        )

    def _mlp_norm_fuses(self, model: DenseDecoder) -> bool:
        """Whether the MLP's residual add and RMS norm go into its first product: the dense MLP's gate/up
        (:meth:`_norm_fuses`), or a mixture of experts' router (:attr:`GemmBackend.fuses_router_norm`), whose
        product also returns the norm's output for the experts."""
        if self.moe is None:
            return self._norm_fuses(model, self.pre_mlp, self.gate_up_fp8, self.gate_up)
        return self._norm_fuses(model, self.pre_mlp, None, self.moe.router, model.gemm.fuses_router_norm)

    def attention_norm(
        self, model: DenseDecoder, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor]:
        """The previous branch added to the residual stream, normalised for the attention block."""
        return self._norm_in(model, hidden, residual, self.pre_attn, self.qkv_fp8, self.pre_attn_bias)

    def finish(
        self, model: DenseDecoder, x: Any, attn_out: torch.Tensor, residual: torch.Tensor, fuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer past its attention block (``attn_out``, after the output projection): the MLP
        branch, reading ``x`` too where both branches read one norm's output. ``fuse``: the MLP's norm may go
        into its first product (:meth:`_norm_fuses`).

        Returns:
            The layer's last branch output and the residual stream it is added to.
        """
        hidden = self._branch_out(model, attn_out, self.post_attn, self.post_attn_bias)
        if model.spec.parallel:
            # both branches read the one norm's output; their sum is the layer's branch
            return hidden + self._branch_out(model, self.mlp(model, x), self.post_mlp, self.post_mlp_bias), residual
        if fuse and self._mlp_norm_fuses(model):
            pending = PendingNorm(hidden, residual, self.pre_mlp, model.config.rms_norm_eps)
            out = self._branch_out(model, self.mlp(model, pending), self.post_mlp, self.post_mlp_bias)
            assert pending.summed is not None, "the gate/up or router product sets the residual stream"
            return out, pending.summed
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
