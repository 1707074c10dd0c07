"""The one dense decoder every built-in architecture runs: load and run a :class:`DecoderSpec`.

An architecture subclasses :class:`DenseDecoder` and implements :meth:`DenseDecoder.decoder_spec`
(plus :meth:`~engine.models.base.CausalLM.config_from_hf` where its config keys differ). The forward
pass is the Llama one with the spec's options switched in; a plain pre-norm SwiGLU model runs exactly
the op sequence it always did, FP8 producers included.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.lora import LoraStep
from engine.interfaces.ops import OpTable
from engine.interfaces.step_overlap import StepOverlap
from engine.kv_groups import GroupedAttentionMetadata
from engine.loader.lazy_tensor import materialize
from engine.loader.weight_slices import dense, weight_rows
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.layers.blocks import DecoderLayer
from engine.models.layers.layer_loader import LayerLoader
from engine.models.layers.moe_block import moe_tensor_parallel_problems
from engine.models.layers.names import decoder_weight_shapes
from engine.models.layers.nano_batches import forward_overlapped, overlaps_step
from engine.models.layers.rope import RotaryEmbedding
from engine.models.layers.spec import DecoderSpec
from engine.models.rotary import rope_type
from engine.parallel.pipeline_parallel import PipelineStage, pipeline_parallel_problems
from engine.parallel.tensor_parallel import TensorParallel, tensor_parallel_problems


class DenseDecoder(CausalLM):
    """A decoder-only transformer described by a :class:`DecoderSpec`.

    Args:
        config: the model's sizes.
        ops: the op table (reference ops with the platform's overrides).
        attention: the platform's attention backend.
        gemm: the platform's GEMM backend.
        dtype: activation and weight dtype.
        device: where tensors live.
    """

    #: the forward takes one metadata per KV group, so interleaved windows free memory (engine.kv_groups)
    supports_kv_groups: ClassVar[bool] = True
    #: ``tie_word_embeddings`` when a config.json leaves it out (the HF config class's default)
    tie_embeddings_default: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        ops: OpTable,
        attention: AttentionBackend,
        gemm: GemmBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(config, ops, attention, gemm, dtype, device)
        self.spec = self.decoder_spec(config)
        if self.spec.scale is not None:
            self.scale = self.spec.scale
        #: this rank's place in a tensor-parallel group (None: the whole model here); see use_tensor_parallel
        self.tp: TensorParallel | None = None
        #: this rank's pipeline stage (None: every layer here); see use_pipeline_parallel
        self.pp: PipelineStage | None = None
        #: the heads (and their widths) this process computes: all of them unless tensor-parallel
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.rotaries = [RotaryEmbedding(r, config.max_position_embeddings, device) for r in self.spec.ropes]
        # one table for the single-rotary models, as the plugins' tests and benchmarks expect
        self.cos_sin_cache = self.rotaries[0].cache if self.rotaries else None
        #: each layer's attention window (None: global), for the block manager and the capability check
        self.layer_windows = [layer.sliding_window for layer in self.spec.layers]
        self.embed_scale = (
            torch.tensor(self.spec.embed_scale, dtype=dtype, device=device) if self.spec.embed_scale is not None else None
        )
        self.layers: list[DecoderLayer] = []
        self._fuses_post_norms: bool | None = None
        self.embed_tokens: torch.Tensor | None = None
        #: the first vocabulary row of ``embed_tokens`` (this rank's rows under tensor parallelism)
        self.vocab_start = 0
        self.final_norm: torch.Tensor | None = None
        self.final_norm_bias: torch.Tensor | None = None
        self.lm_head: Any = None
        #: the GEMM backend's plan of this step's adapter rows (``GemmBackend.plan_lora``), None without
        #: adapters, and the step itself (the embeddings' adapters read its slots); see :meth:`use_lora_step`
        self.lora_plan: Any = None
        self.lora_step: LoraStep | None = None
        #: the plan of the logits rows' adapters (the lm_head's), set by :meth:`use_lora_logits`
        self.lora_logits_plan: Any = None
        #: the adapter slots of the lm_head and of the embeddings (``engine.lora.slots``), None without
        self.lora_head: Any = None
        self.lora_embed: Any = None
        #: the adapters' slots (``engine.lora.slots.LoraSlots``), which say whether any adapter updates
        #: the lm_head or the embeddings
        self.lora_slots: Any = None
        #: layers whose input (the residual stream) each forward keeps in :attr:`aux_hidden_states`, in
        #: layer order (an EAGLE-3 head reads them; empty: none kept)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []
        #: the platform's lanes when large decode steps run as two overlapped nano-batches
        #: (``enable_dbo``, :mod:`engine.models.layers.nano_batches`), None: every step runs whole
        self.step_overlap: StepOverlap | None = None
        #: the fewest sequences of a decode step that runs overlapped (``dbo_decode_token_threshold``)
        self.dbo_threshold = 0

    # --- what the loader asks of the class ----------------------------------------------------------

    @classmethod
    @abstractmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """The architecture's :class:`DecoderSpec` for ``config``.

        Args:
            config: the model config (``hf_config`` holds the raw keys, or those a GGUF file's metadata
                stands for).

        Returns:
            The spec.
        """

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The Llama-family keys, with the window and context the spec implies.

        ``sliding_window`` stays set only when every layer slides by the same window (the runner puts it
        in every step's metadata; interleaved layers get theirs per layer from the model). A ``dynamic``
        RoPE model's context is ``max_position_embeddings * factor``.
        """
        config = ModelConfig.from_hf_dict(hf_config)
        windows = {layer.sliding_window for layer in cls.decoder_spec(config).layers}
        config.sliding_window = windows.pop() if len(windows) == 1 else None
        config.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", cls.tie_embeddings_default))
        if rope_type(config.rope_scaling) == "dynamic" and config.rope_scaling is not None:
            config.max_position_embeddings = int(config.max_position_embeddings * float(config.rope_scaling["factor"]))
        return config

    @classmethod
    def required_features(cls, config: ModelConfig) -> dict[str, str]:
        """Attention features the model needs: capability field -> what it is called in messages."""
        spec = cls.decoder_spec(config)
        needs: dict[str, str] = {}
        if any(layer.sliding_window is not None for layer in spec.layers):
            needs["sliding_window"] = "sliding-window attention"
        if spec.attn_soft_cap is not None:
            needs["logits_soft_cap"] = "attention logits soft-capping"
        if spec.attention_sinks:
            needs["attention_sinks"] = "attention sinks"
        return needs

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of the architecture's checkpoints by HF name, as the spec names them."""
        return decoder_weight_shapes(cls.decoder_spec(config), config)

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Recomputed rotary buffers, and the copy of the embeddings some tied checkpoints store."""
        return super().ignores_weight(name, config) or (config.tie_word_embeddings and name == "lm_head.weight")

    # --- loading -------------------------------------------------------------------------------------

    def use_tensor_parallel(self, tp: TensorParallel) -> None:
        """Hold and compute only this rank's slice (call before :meth:`load_weights`).

        Raises:
            ValueError: the model does not split ``tp.size`` ways (every reason listed).
        """
        cfg = self.config
        problems = self._tensor_parallel_problems(cfg, self.spec, tp.size, tp.expert_parallel)
        if problems:
            raise ValueError("; ".join(problems))
        self.tp = tp
        self.num_heads = tp.heads(cfg.num_heads)[1]
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)[1]
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim

    def use_pipeline_parallel(self, pp: PipelineStage) -> None:
        """Hold and run only this stage's layers (call before :meth:`load_weights`).

        Raises:
            ValueError: the model does not split into ``pp.size`` stages (every reason listed).
        """
        problems = self._pipeline_parallel_problems(self.config, self.spec, pp.size)
        if problems:
            raise ValueError("; ".join(problems))
        self.pp = pp
        self.layer_windows = [self.layer_windows[i] for i in pp.layers]

    @classmethod
    def parallel_problems(
        cls, config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel: bool
    ) -> list[str]:
        spec = cls.decoder_spec(config)
        problems = []
        if tensor_parallel_size > 1:
            problems += cls._tensor_parallel_problems(config, spec, tensor_parallel_size, expert_parallel)
        if pipeline_parallel_size > 1:
            problems += cls._pipeline_parallel_problems(config, spec, pipeline_parallel_size)
        return problems

    @staticmethod
    def _tensor_parallel_problems(config: ModelConfig, spec: DecoderSpec, size: int, expert_parallel: bool) -> list[str]:
        problems = tensor_parallel_problems(config, size, spec.qk_norm)
        if spec.moe is not None:
            problems += moe_tensor_parallel_problems(spec.moe, size, expert_parallel)
        if spec.mla is not None:
            problems.append(f"{config.architecture}'s latent attention does not split over tensor-parallel ranks yet")
        return problems

    @staticmethod
    def _pipeline_parallel_problems(config: ModelConfig, spec: DecoderSpec, size: int) -> list[str]:
        windows = {layer.sliding_window for layer in spec.layers}
        post_norms = spec.norms.post_attn is not None or spec.norms.post_mlp is not None
        return pipeline_parallel_problems(config.num_layers, size, len(windows) > 1, post_norms)

    @property
    def num_local_layers(self) -> int:
        """The layers this process runs (and keeps KV for): all of them unless pipeline-parallel."""
        return len(self.spec.layers) if self.pp is None else len(self.pp.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Take HF-named tensors, fuse q/k/v and gate/up, and hand every matrix to the GEMM backend.

        Raises:
            ValueError: if a tensor the architecture needs is missing or has the wrong shape.
        """
        cfg = self.config
        tensors: dict[str, Any] = {name: t for name, t in weights if "rotary_emb" not in name}
        loader = LayerLoader(self, tensors)
        # read only as far as this rank needs it: its vocabulary rows under tensor parallelism, nothing on a
        # later pipeline stage of an untied model
        embed = loader.take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), lazy_ok=True)
        pp = self.pp
        if pp is None or pp.is_first:
            if self.tp is not None:
                # vocab-parallel: this rank's rows (the last rank's may be short); forward sums the ranks'
                own, _ = self.tp.vocab_rows(cfg.vocab_size)
                self.vocab_start = own.start
                embed_rows = materialize(weight_rows(dense(embed), own))
            else:
                embed_rows = dense(materialize(embed))
            self.embed_tokens = embed_rows.to(device=self.device, dtype=self.dtype)
            del embed_rows
        for i, layer_spec in enumerate(self.spec.layers):
            if pp is None or i in pp.layers:
                self.layers.append(loader.layer(self.hf_layer_prefix.format(i), layer_spec))
        if pp is not None and not pp.is_last:
            return  # the final norm and the lm_head are the last stage's
        self.final_norm = loader.norm("model.norm", cfg.hidden_size)
        self.final_norm_bias = loader.norm_bias("model.norm", cfg.hidden_size)
        # the lm_head stays in the model dtype under load-time quantization: its logits pick the tokens
        if cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            head = embed if self.tp is not None else materialize(embed)
        else:
            head = loader.take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), lazy_ok=self.tp is not None)
        tensors.pop("lm_head.weight", None)
        if self.tp is not None:
            # this rank's vocabulary rows, the last rank's padded so that every rank gathers as many
            own, per_rank = self.tp.vocab_rows(cfg.vocab_size)
            if isinstance(head, QuantizedWeight) and own.stop - own.start == per_rank:
                head = weight_rows(head, own)  # no padding needed: the rows stay quantized
            else:
                rows = materialize(weight_rows(dense(head), own))
                head = torch.zeros(per_rank, cfg.hidden_size, dtype=rows.dtype, device=rows.device)
                head[: own.stop - own.start] = rows
        self.lm_head = loader.matrix(head, projection=False)

    # --- forward -------------------------------------------------------------------------------------

    def use_lora_step(self, step: LoraStep | None) -> None:
        """The adapter slot of each row of the next forward (None: no row has one)."""
        self.lora_step = step
        self.lora_plan = None if step is None else self.gemm.plan_lora(step)

    def use_lora_logits(self, step: LoraStep | None) -> None:
        """The adapter slot of each row of the next :meth:`compute_logits` (None: no row has one)."""
        unused = self.lora_slots is None or not self.lora_slots.head_slots
        self.lora_logits_plan = None if step is None or unused else self.gemm.plan_lora(step)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The spec's norm kind over the last dim (``bias`` only for LayerNorms)."""
        if self.spec.norm == "layer":
            return self.ops.layer_norm(x, weight, bias, self.config.rms_norm_eps)
        return self.ops.rms_norm(x, weight, self.config.rms_norm_eps)

    def layer_metadata(self, metadata: AttentionMetadata) -> list[AttentionMetadata]:
        """Each layer's metadata: the step's, or a copy with the layer's window and soft-cap."""
        # each distinct (window, cap) gets its own metadata copy with its own extras, so a backend's
        # per-step plan is built once per variant, not once per layer
        cap = self.spec.attn_soft_cap
        variants: dict[tuple[int | None, float | None], AttentionMetadata] = {
            (metadata.sliding_window, metadata.logits_soft_cap): metadata
        }
        chosen = []
        for layer in self.layers:
            key = (layer.window, cap)
            if key not in variants:
                variants[key] = dataclasses.replace(metadata, sliding_window=layer.window, logits_soft_cap=cap, extras={})
            chosen.append(variants[key])
        return chosen

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: AttentionMetadata | GroupedAttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm, for a flat batch of tokens.

        ``metadata`` is one per KV group when the engine keeps a table per group (see
        :mod:`engine.kv_groups`; :attr:`supports_kv_groups`), and ``kv_caches`` then holds each layer's
        tensor of the shared pool."""
        ops, eps = self.ops, self.config.rms_norm_eps
        overlap = self.step_overlap
        if overlap is not None and overlaps_step(self, input_ids.shape[0], metadata, self.dbo_threshold):
            return forward_overlapped(self, input_ids, positions, kv_caches, metadata, overlap)
        pp = self.pp
        residual: torch.Tensor | None = None
        if pp is not None and not pp.is_first:
            hidden, residual = pp.recv_activations(input_ids.shape[0], self.config.hidden_size, self.dtype, self.device)
        else:
            hidden = self.embed_step(input_ids)
        if isinstance(metadata, GroupedAttentionMetadata):
            # one table per KV group: each layer attends with its group's tables and window
            layer_metadata = metadata.for_layers(self.spec.attn_soft_cap)
            metadata = metadata.primary
        else:
            layer_metadata = self.layer_metadata(metadata)
        tables = [rotary.step_table(positions, metadata) for rotary in self.rotaries]
        if self.fuses_post_norms:
            pending: torch.Tensor | None = None
            for layer, kv_cache, meta in zip(self.layers, kv_caches, layer_metadata):
                hidden, residual = layer.forward_post_normed(self, hidden, residual, pending, tables, kv_cache, meta)
                pending = layer.post_mlp
            out, _ = ops.post_norm_add_rms_norm(hidden, residual, pending, self.final_norm, eps)
            return out
        aux = self.aux_hidden_layers
        if aux:
            self.aux_hidden_states = []
        for i, (layer, kv_cache, meta) in enumerate(zip(self.layers, kv_caches, layer_metadata)):
            if i in aux:
                stream = hidden if residual is None else hidden + residual
                self.aux_hidden_states.append(stream.to(self.dtype))
            hidden, residual = layer.forward(self, hidden, residual, tables, kv_cache, meta)
        if pp is not None and not pp.is_last:
            assert residual is not None  # every stage runs at least one layer
            pp.send_activations(hidden, residual)
            return hidden  # stage 0 reads only its rows' count (the logits come from the last stage)
        assert residual is not None  # every model has a layer
        return self.final_norm_of(hidden, residual)

    def final_norm_of(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's branch added to the residual stream, through the final norm."""
        eps = self.config.rms_norm_eps
        if self.spec.norm == "layer":
            return self.ops.layer_norm(hidden + residual, self.final_norm, self.final_norm_bias, eps)
        out, _ = self.ops.fused_add_rms_norm(hidden, residual, self.final_norm, eps)
        return out

    def embed_step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings as the first layer takes them (scaled where the spec says so)."""
        hidden = self._embed(input_ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    @property
    def fuses_post_norms(self) -> bool:
        """Whether each branch's post-norm, residual add and the next pre-norm run as one op: RMS norms
        before and after both branches, no residual scale, and no FP8 producer that the pre-norms would
        have to write (those keep the unfused path). Decided once the weights are loaded."""
        if self._fuses_post_norms is None:
            self._fuses_post_norms = self._can_fuse_post_norms()
        return self._fuses_post_norms

    def _can_fuse_post_norms(self) -> bool:
        spec, norms = self.spec, self.spec.norms
        return (
            spec.norm == "rms"
            and not spec.parallel
            and spec.residual_multiplier is None
            and None not in (norms.pre_attn, norms.post_attn, norms.pre_mlp, norms.post_mlp)
            and bool(self.layers)
            and all(layer.qkv_fp8 is None and layer.gate_up_fp8 is None for layer in self.layers)
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; under tensor parallelism each rank looks up the ids in its rows (zeros
        for the others) and the ranks' sum is every token's row."""
        assert self.embed_tokens is not None
        if self.tp is None:
            hidden = self.embed_tokens.index_select(0, input_ids)
            # inside a recorded graph it always runs: an adapter loaded later may update the embeddings
            if self.lora_step is not None and (self.lora_step.token_slots_cpu is None or self.lora_slots.embed_slots):
                self.lora_embed.add(self.gemm, hidden, input_ids, self.lora_step, self.lora_plan)
            return hidden
        rows = self.embed_tokens.shape[0]
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < rows)
        hidden = self.embed_tokens.index_select(0, local.clamp(0, rows - 1)) * inside.unsqueeze(-1).to(self.dtype)
        return self.tp.reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` for the selected hidden rows, after any logit scale or soft-cap.

        Pipeline-parallel: the last stage computes them and sends them to stage 0, which returns them; a
        middle stage returns None."""
        pp = self.pp
        if pp is not None and not pp.is_last:
            return pp.recv_logits(hidden.shape[0], self.config.vocab_size, self.device) if pp.is_first else None
        logits = self.gemm.logits(hidden, self.lm_head)
        if self.lora_logits_plan is not None:
            self.gemm.add_lora(logits, hidden, self.lora_head, self.lora_logits_plan)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.config.vocab_size)
        if self.spec.logit_scale is not None:
            logits = logits * self.spec.logit_scale
        if self.spec.logits_divisor is not None:
            logits = logits / self.spec.logits_divisor
        if self.spec.final_soft_cap is not None:
            cap = self.spec.final_soft_cap
            logits = torch.tanh(logits / cap) * cap
        if pp is not None:
            pp.send_logits(logits)
        return logits
