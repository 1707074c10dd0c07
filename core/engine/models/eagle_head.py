"""An EAGLE head on the platform's backends: one Llama decoder layer that reads the token embeddings
together with the target's hidden states, proposing the target's next tokens.

EAGLE-1 (``eagle``): ``x = fc(concat(embed(token[t + 1]), h[t]))``, where ``h`` is the target's last hidden
state (after its final norm); then the layer without an input norm (its residual stream starts at
``x``); its output (stream plus MLP, no final norm, as the published head and the leading engine's
``EagleLlamaForCausalLM`` run it) goes through the target's LM head and is the hidden state of the next
draft position. EAGLE-3 (``eagle3``): ``h`` is ``fc`` of three target layers' inputs concatenated (or, for
later draft positions, the head's own output); the layer's attention reads
``concat(input_layernorm(embed), hidden_norm(h))`` (``2 * hidden`` wide) with the residual stream starting
at ``h``; its output goes through the head's ``norm`` and its own LM head over ``draft_vocab_size`` tokens,
whose ids ``d2t`` maps to the target's; the output before that norm is the next position's ``h``.

The target's embeddings (and, for EAGLE-1, its LM head) are shared, not copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.loader.lazy_tensor import materialize
from engine.models.config import ModelConfig
from engine.models.layers.blocks import DecoderLayer
from engine.models.layers.decoder import DenseDecoder
from engine.models.layers.layer_loader import LayerLoader
from engine.models.layers.spec import DecoderSpec, LayerSpec, NormNames
from engine.models.llama import standard_rope

EagleKind = Literal["eagle", "eagle3"]
#: checkpoint tensors a head may carry that the engine does not use: EAGLE-1's frozen copy of the target's
#: embeddings and the unused final norm some EAGLE-1 trainers save; EAGLE-3's target-to-draft mask
_UNUSED = {"eagle": ("embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight"), "eagle3": ("t2d",)}


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    """An EAGLE head as its folder describes it.

    Attributes:
        kind: ``eagle`` (EAGLE-1/2 heads) or ``eagle3``.
        model: the head's sizes (one decoder layer); its context is the target's.
        path: the head's folder.
        aux_layers: ``eagle3``: the target layers whose input (the residual stream) the head reads, in
            layer order; empty for ``eagle``.
        draft_vocab_size: ``eagle3``: the rows of the head's own LM head (``d2t`` maps them to target
            ids); the target's vocabulary for ``eagle``.
        norm_before_residual: ``eagle3``: the residual stream starts from the normalised hidden state.
    """

    kind: EagleKind
    model: ModelConfig
    path: str
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    norm_before_residual: bool = False


class EagleHead(DenseDecoder):
    """The head as a one-layer model the engine's :class:`~engine.model_runner.ModelRunner` runs.

    Before each forward the proposer hands it the hidden state of every input row
    (:meth:`use_hidden`); after it, :attr:`last_hidden` holds the head's own hidden states, which the next
    draft position reads.

    Args:
        head: the head's config.
        target: the loaded target model (its embeddings, LM head, op table and GEMM backend are shared).
        attention: the attention backend of the head's own KV pool.
    """

    def __init__(self, head: EagleHeadConfig, target: DenseDecoder, attention: AttentionBackend) -> None:
        super().__init__(head.model, target.ops, attention, target.gemm, target.dtype, target.device)
        self.kind = head.kind
        self.norm_before_residual = head.norm_before_residual
        self.draft_vocab_size = head.draft_vocab_size
        self.target_vocab_size = target.config.vocab_size
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head if head.kind == "eagle" else None
        self.fc: Any = None
        self.fc_bias: torch.Tensor | None = None
        self.layer: DecoderLayer | None = None
        #: EAGLE-3's norms of the embeddings and of the hidden state before its layer's attention
        self.embed_norm: torch.Tensor | None = None
        self.hidden_norm: torch.Tensor | None = None
        #: EAGLE-3: the target id of each draft-vocabulary row (None: the vocabularies are the same)
        self.draft_to_target: torch.Tensor | None = None
        #: the hidden state of each row of the next forward (set by :meth:`use_hidden`)
        self.hidden_in: torch.Tensor | None = None
        #: the last forward's output per row: the hidden state its next draft position reads
        self.last_hidden: torch.Tensor | None = None

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """One Llama layer whose input norm, where the head has one, the head applies itself."""
        return DecoderSpec(
            layers=(LayerSpec(),),
            ropes=(standard_rope(config),),
            norms=NormNames(pre_attn=None),
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
        )

    @property
    def fc_input_size(self) -> int:
        """The width ``fc`` reads: embedding and hidden state (EAGLE-1), or three target layers (EAGLE-3)."""
        return (2 if self.kind == "eagle" else 3) * self.config.hidden_size

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take the head's tensors by their checkpoint names.

        Raises:
            ValueError: a tensor is missing, misshapen, or not part of the head's layout.
        """
        h = self.config.hidden_size
        tensors: dict[str, Any] = {name: materialize(t) for name, t in weights if "rotary_emb" not in name}
        for name in _UNUSED[self.kind]:
            tensors.pop(name, None)
        loader = LayerLoader(self, tensors)
        self.fc = loader.matrix(loader.take("fc.weight", (h, self.fc_input_size)), projection=False)
        if "fc.bias" in tensors:
            self.fc_bias = loader.take("fc.bias", (h,)).to(device=self.device, dtype=self.dtype)
        if self.kind == "eagle":
            self.layer = loader.layer("layers.0.", self.spec.layers[0])
        else:
            self._load_eagle3(loader, tensors)
        if tensors:
            raise ValueError(f"tensors not in the {self.kind} head layout: {', '.join(sorted(tensors)[:5])}")

    def _load_eagle3(self, loader: LayerLoader, tensors: dict[str, Any]) -> None:
        cfg, h = self.config, self.config.hidden_size
        p = "midlayer."
        self.embed_norm = loader.norm(p + "input_layernorm", h)
        self.hidden_norm = loader.norm(p + "hidden_norm", h)
        # the attention reads 2 * hidden: the layer is loaded with stand-ins of the usual width, then its
        # fused projection is replaced by the real one (the GEMM takes any input width)
        sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        qkv = []
        for name, size in zip(("q_proj", "k_proj", "v_proj"), sizes):
            full = loader.take(f"{p}self_attn.{name}.weight", (size, 2 * h))
            qkv.append(full)
            tensors[f"{p}self_attn.{name}.weight"] = full[:, :h]
        self.layer = loader.layer(p, self.spec.layers[0])
        self.layer.qkv = loader.matrix(torch.cat(qkv))
        self.final_norm = loader.norm("norm", h)
        self.lm_head = loader.matrix(loader.take("lm_head.weight", (self.draft_vocab_size, h)), projection=False)
        if "embed_tokens.weight" in tensors:
            own = loader.take("embed_tokens.weight", (self.target_vocab_size, h))
            self.embed_tokens = own.to(device=self.device, dtype=self.dtype)
        if "d2t" in tensors:
            offsets = loader.take("d2t", (self.draft_vocab_size,)).to(device=self.device, dtype=torch.long)
            self.draft_to_target = torch.arange(self.draft_vocab_size, device=self.device) + offsets
            if int(self.draft_to_target.min()) < 0 or int(self.draft_to_target.max()) >= self.target_vocab_size:
                raise ValueError(f"d2t maps draft tokens outside the target's {self.target_vocab_size} ids")
        elif self.draft_vocab_size != self.target_vocab_size:
            raise ValueError(f"a draft vocabulary of {self.draft_vocab_size} tokens needs d2t, its map to target ids")

    # --- forward -------------------------------------------------------------------------------------

    def use_hidden(self, hidden: torch.Tensor) -> None:
        """The hidden state of each row of the next forward: the target's (EAGLE-3: three layers' inputs,
        put through ``fc`` here) or, for a later draft position, the head's own."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.gemm.linear(hidden.to(self.dtype), self.fc, self.fc_bias)
        self.hidden_in = hidden.to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: Any,
    ) -> torch.Tensor:
        """The head's output for each row (the next position's hidden state; logits read it too).

        Raises:
            ValueError: the rows' hidden states were not given, or their count differs.
        """
        hidden = self.hidden_in
        if hidden is None or hidden.shape[0] != input_ids.shape[0]:
            raise ValueError("the EAGLE head needs one hidden state per input row (use_hidden)")
        self.hidden_in = None
        assert isinstance(metadata, AttentionMetadata) and self.layer is not None
        ops, eps, layer = self.ops, self.config.rms_norm_eps, self.layer
        embeds = self._embed(input_ids)
        tables = [rotary.step_table(positions, metadata) for rotary in self.rotaries]
        if self.kind == "eagle":
            x = self.gemm.linear(torch.cat((embeds, hidden), dim=-1), self.fc, self.fc_bias)
            residual = x
        else:
            assert self.embed_norm is not None and self.hidden_norm is not None
            normed = ops.rms_norm(hidden, self.hidden_norm, eps)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat((ops.rms_norm(embeds, self.embed_norm, eps), normed), dim=-1)
        attn = layer.attention(self, x, tables, kv_caches[0], metadata)
        x, residual = ops.fused_add_rms_norm(attn, residual, layer.pre_mlp, eps)
        out = (layer.mlp(self, x) + residual).to(self.dtype)
        self.last_hidden = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary for the selected rows (EAGLE-3: tokens outside
        the draft vocabulary at ``-inf``)."""
        if self.kind == "eagle":
            return self.gemm.logits(hidden, self.lm_head)
        assert self.final_norm is not None
        logits = self.gemm.logits(self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full
