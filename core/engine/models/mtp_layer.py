"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a speculative draft like an EAGLE head.

A checkpoint with ``num_nextn_predict_layers`` >= 1 stores its MTP layer(s) after the last decoder layer,
as ``model.layers.{num_hidden_layers + i}.*``:

- ``enorm`` / ``hnorm``: RMSNorms of the embedding of token ``t + 1`` and of the target's hidden state at
  ``t`` (its last one, after the final norm: the rows its LM head reads);
- ``eh_proj``: ``[hidden, 2 * hidden]`` over ``concat(enorm(embed), hnorm(h))``, no bias;
- a full decoder block of the target's kind at that layer index (DeepSeek: latent attention, and experts
  or a dense MLP as ``first_k_dense_replace`` / ``moe_layer_freq`` say for it), whose residual stream
  starts at ``eh_proj``'s output; its output (stream plus MLP, no norm) is the next draft position's
  hidden state;
- ``shared_head.norm`` / ``shared_head.head``: the norm and LM head that turn that output into logits
  (the target's final norm and LM head where absent), and ``embed_tokens`` (the target's where absent).

As the leading engine runs it, the embedding at position 0 is zeroed (the layer was not trained to use
it). GLM-4.5 (``Glm4MoeForCausalLM``) stores its MTP layer in the same layout, with its own block kind.
Only the first MTP layer is run, for every draft position, as the leading engine does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.layers.blocks import DecoderLayer
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.layer_loader import LayerLoader
from engine.models.layers.spec import DecoderSpec


def mtp_layer_index(config: ModelConfig) -> int:
    """The checkpoint index of the first MTP layer: right after the target's last decoder layer."""
    return int(config.hf_config["num_hidden_layers"])


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The MTP layer's config: the target's, one layer deep (its raw keys still the target's)."""
    return dataclasses.replace(target, num_layers=1, hf_config=dict(target.hf_config))


class MtpLayer(DenseDecoder):
    """The MTP layer as a one-layer model the engine's :class:`~engine.model_runner.ModelRunner` runs.

    Made per target architecture with :meth:`for_target` (its block is that architecture's). Before each
    forward the proposer hands it each row's hidden state (:meth:`use_hidden`); after it,
    :attr:`last_hidden` holds the layer's output rows, which the next draft position reads.

    Args:
        config: :func:`mtp_config` of the target's.
        target: the loaded target model (its embeddings, LM head, final norm, op table and GEMM backend
            are shared).
        attention: the attention backend of the layer's own KV pool.
    """

    #: the target architecture whose block the layer is
    target_class: ClassVar[type[DenseDecoder]]

    def __init__(self, config: ModelConfig, target: DenseDecoder, attention: AttentionBackend) -> None:
        super().__init__(config, target.ops, attention, target.gemm, target.dtype, target.device)
        # load-time quantization treats the layer's projections as the target's
        self.linear_quantizer = target.linear_quantizer
        self.target_vocab_size = target.config.vocab_size
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.final_norm = target.final_norm
        self.enorm: torch.Tensor | None = None
        self.hnorm: torch.Tensor | None = None
        self.eh_proj: Any = None
        self.layer: DecoderLayer | None = None
        #: the hidden state of each row of the next forward (set by :meth:`use_hidden`)
        self.hidden_in: torch.Tensor | None = None
        #: the last forward's output per row: the hidden state its next draft position reads
        self.last_hidden: torch.Tensor | None = None

    @classmethod
    def for_target(cls, target_class: type[DenseDecoder]) -> type[MtpLayer]:
        """The MTP layer class of a target architecture."""
        return type(f"Mtp{target_class.__name__}", (cls,), {"target_class": target_class})

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """The target's spec with its one layer the target's at the MTP layer's index (experts or not)."""
        index = mtp_layer_index(config)
        spec = cls.target_class.decoder_spec(dataclasses.replace(config, num_layers=index + 1))
        return dataclasses.replace(spec, layers=(spec.layers[index],))

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Everything but the first MTP layer's tensors (the target's own are loaded already)."""
        return not name.startswith(f"model.layers.{mtp_layer_index(config)}.") or "rotary_emb" in name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take the first MTP layer's tensors by their checkpoint names (``model.layers.{N}.*``).

        Raises:
            ValueError: a tensor is missing, misshapen, or not part of the MTP layout.
        """
        cfg, h = self.config, self.config.hidden_size
        p = f"model.layers.{mtp_layer_index(cfg)}."
        tensors: dict[str, Any] = {name: t for name, t in weights if name.startswith(p)}
        loader = LayerLoader(self, tensors)
        self.enorm = loader.norm(p + "enorm", h)
        self.hnorm = loader.norm(p + "hnorm", h)
        self.eh_proj = loader.matrix(loader.take(p + "eh_proj.weight", (h, 2 * h)))
        if p + "embed_tokens.weight" in tensors:
            own = loader.take(p + "embed_tokens.weight", (cfg.vocab_size, h))
            self.embed_tokens = own.to(device=self.device, dtype=self.dtype)
        if p + "shared_head.norm.weight" in tensors:
            self.final_norm = loader.norm(p + "shared_head.norm", h)
        if p + "shared_head.head.weight" in tensors:
            head = loader.take(p + "shared_head.head.weight", (cfg.vocab_size, h))
            # like the target's lm_head, it stays in the model dtype: its logits pick the proposals
            self.lm_head = loader.matrix(head, projection=False)
        self.layer = loader.layer(p, self.spec.layers[0])
        self.layers = [self.layer]
        if tensors:
            raise ValueError(f"tensors not in the MTP layer layout: {', '.join(sorted(tensors)[:5])}")

    # --- forward -------------------------------------------------------------------------------------

    def use_hidden(self, hidden: torch.Tensor) -> None:
        """The hidden state of each row of the next forward: the target's, or for a later draft position
        the layer's own output at the position before."""
        self.hidden_in = hidden.to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: Any,
    ) -> torch.Tensor:
        """The layer's output for each row (the next position's hidden state; logits read it too).

        Raises:
            ValueError: the rows' hidden states were not given, or their count differs.
        """
        hidden = self.hidden_in
        if hidden is None or hidden.shape[0] != input_ids.shape[0]:
            raise ValueError("the MTP layer needs one hidden state per input row (use_hidden)")
        self.hidden_in = None
        assert isinstance(metadata, AttentionMetadata) and self.layer is not None
        ops, eps = self.ops, self.config.rms_norm_eps
        # the leading engine masks position 0's embedding: the layer's output there is what it was run with
        embeds = self._embed(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = torch.cat((ops.rms_norm(embeds, self.enorm, eps), ops.rms_norm(hidden, self.hnorm, eps)), dim=-1)
        x = self.gemm.linear(x, self.eh_proj)
        tables = [rotary.step_table(positions, metadata) for rotary in self.rotaries]
        branch, residual = self.layer.forward(self, x, None, tables, kv_caches[0], metadata)
        out = (branch + residual).to(self.dtype)
        self.last_hidden = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary: the shared head's norm, then its LM head."""
        assert self.final_norm is not None
        return self.gemm.logits(self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)
