"""Encoder-only transformers for embeddings and reranking: ``BertModel``, ``XLMRobertaModel`` and their
``...ForSequenceClassification`` cross-encoders (bge, e5, gte, MiniLM, bge-reranker).

Post-norm layers (LayerNorm after each residual add), learned absolute positions (offset past the padding
id for XLM-RoBERTa), token types (a text pair's second text is type 1, found after the first ``[SEP]``),
a GELU MLP, and bidirectional attention over the whole prompt, which therefore runs in one step (the
engine does not chunk these prompts). They serve pooling requests only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from engine.interfaces.attention import AttentionMetadata
from engine.loader.lazy_tensor import materialize
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.weights import take_tensor

_LAYER = "encoder.layer.{}."
_PARTS = {
    "attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v",
    "attention.output.dense": "o", "intermediate.dense": "up", "output.dense": "down",
}  # fmt: skip


class BertModel(CausalLM):
    """``BertModel``: the encoder whose last hidden states are pooled (CLS unless its sentence-transformers
    files say otherwise)."""

    generates: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "CLS"
    #: bidirectional attention: a prompt is computed in one step
    needs_whole_prompt: ClassVar[bool] = True
    #: a CLS-pooled step computes the last layer's output and MLP for the CLS rows only
    prunes_to_output_rows: ClassVar[bool] = True
    #: the tensor names' prefix (``bert.`` in a classifier's checkpoint)
    prefix: ClassVar[str] = ""
    #: a BERT pooler (dense + tanh on CLS) is in the checkpoint
    has_pooler: ClassVar[bool] = True
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = ("position_ids", "rotary_emb.inv_freq")
    #: the token id that closes a pair's first text (the engine sets it from the tokenizer); None: one type
    sep_token_id: int | None = None

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The encoder's sizes; the usable context is the position table less any offset."""
        config = ModelConfig.from_hf_dict(hf_config)
        config.rms_norm_eps = float(hf_config.get("layer_norm_eps", 1e-12))
        config.max_position_embeddings -= cls.position_offset(hf_config)
        config.tie_word_embeddings = True
        return config

    @classmethod
    def position_offset(cls, hf_config: dict[str, Any]) -> int:
        """Where position 0 sits in the position table (past the padding id for XLM-RoBERTa)."""
        return 0

    @classmethod
    def required_features(cls, config: ModelConfig) -> dict[str, str]:
        """Bidirectional attention."""
        return {"non_causal_attention": "bidirectional (encoder) attention"}

    @classmethod
    def head_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The classification head's tensors (none for the bare encoder)."""
        return {}

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Embeddings, layers, pooler and head, by HF name."""
        hf, h, inter, p = config.hf_config, config.hidden_size, config.intermediate_size, cls.prefix
        positions = config.max_position_embeddings + cls.position_offset(hf)
        shapes: dict[str, tuple[int, ...]] = {
            p + "embeddings.word_embeddings.weight": (config.vocab_size, h),
            p + "embeddings.position_embeddings.weight": (positions, h),
            p + "embeddings.token_type_embeddings.weight": (int(hf.get("type_vocab_size", 2)), h),
            p + "embeddings.LayerNorm.weight": (h,), p + "embeddings.LayerNorm.bias": (h,),
        }  # fmt: skip
        for i in range(config.num_layers):
            layer = p + _LAYER.format(i)
            for name in _PARTS:
                rows, cols = (inter, h) if name == "intermediate.dense" else (h, inter) if name == "output.dense" else (h, h)
                shapes[layer + name + ".weight"] = (rows, cols)
                shapes[layer + name + ".bias"] = (rows,)
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                shapes[layer + norm + ".weight"] = (h,)
                shapes[layer + norm + ".bias"] = (h,)
        if cls.has_pooler:
            shapes.update({p + "pooler.dense.weight": (h, h), p + "pooler.dense.bias": (h,)})
        shapes.update(cls.head_shapes(config))
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take every tensor in the model dtype; q/k/v fused into one projection per layer."""
        tensors = dict(weights)
        shapes = self.weight_shapes(self.config)
        dev, dt = self.device, self.dtype

        def take(name: str) -> torch.Tensor:
            return torch.as_tensor(materialize(take_tensor(tensors, name, shapes[name]))).to(device=dev, dtype=dt)

        p = self.prefix
        self.word, self.position, self.token_type = (take(p + f"embeddings.{n}.weight") for n in ("word_embeddings", "position_embeddings", "token_type_embeddings"))
        self.embed_norm = (take(p + "embeddings.LayerNorm.weight"), take(p + "embeddings.LayerNorm.bias"))
        self.layers: list[dict[str, Any]] = []
        for i in range(self.config.num_layers):
            layer = p + _LAYER.format(i)
            parts = {short: (take(layer + name + ".weight"), take(layer + name + ".bias")) for name, short in _PARTS.items()}
            qkv_w = torch.cat([parts[k][0] for k in "qkv"])
            qkv_b = torch.cat([parts[k][1] for k in "qkv"])
            self.layers.append({
                "qkv": (self.gemm.prepare_weight(qkv_w, dt), qkv_b),
                **{k: (self.gemm.prepare_weight(parts[k][0], dt), parts[k][1]) for k in ("o", "up", "down")},
                "attn_norm": (take(layer + "attention.output.LayerNorm.weight"), take(layer + "attention.output.LayerNorm.bias")),
                "out_norm": (take(layer + "output.LayerNorm.weight"), take(layer + "output.LayerNorm.bias")),
            })  # fmt: skip
        self.pooler = (take(p + "pooler.dense.weight"), take(p + "pooler.dense.bias")) if self.has_pooler else None
        self.load_head({n: take(n) for n in self.head_shapes(self.config)})

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the classification head's tensors (none for the bare encoder)."""

    def _token_types(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.sep_token_id is None or self.token_type.shape[0] < 2:
            return torch.zeros_like(input_ids)
        # a token is type 1 once its sequence has passed its first [SEP]: count SEPs before each token
        # within its own sequence (the running count minus the count at the sequence's start)
        seps = (input_ids == self.sep_token_id).to(torch.int64)
        before = torch.cumsum(seps, 0) - seps
        starts = metadata.query_start_loc[:-1].to(torch.int64)
        # lengths from the device's own offsets, and the output size given: neither a copy from the host
        # nor a size read back waits for the step still running
        lengths = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        base = before[starts].repeat_interleave(lengths, output_size=input_ids.shape[0])
        return ((before - base) > 0).to(torch.int64)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of whole prompts (one step each); with ``output_rows``,
        only those rows ``[len(output_rows), hidden]``: the last layer attends from every row (its keys
        and values need them all) and takes only these past its attention."""
        ops, gemm, eps = self.ops, self.gemm, self.config.rms_norm_eps
        meta = dataclasses.replace(metadata, causal=False)
        offset = self.position_offset(self.config.hf_config)
        x = self.word.index_select(0, input_ids) + self.position.index_select(0, positions + offset)
        x = x + self.token_type.index_select(0, self._token_types(input_ids, metadata))
        x = ops.layer_norm(x, *self.embed_norm, eps)
        heads, d = self.config.num_heads, self.config.head_dim
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            q, k, v = gemm.linear(x, *layer["qkv"]).split(heads * d, dim=-1)
            shape = (x.shape[0], heads, d)
            attn = self.attention.forward(q.reshape(shape), k.reshape(shape), v.reshape(shape), cache, meta)
            attn = attn.reshape(x.shape[0], heads * d)
            if i == last and output_rows is not None:
                attn, x = attn.index_select(0, output_rows), x.index_select(0, output_rows)
            x = ops.add_layer_norm(gemm.linear(attn, *layer["o"]), x, *layer["attn_norm"], eps)
            if "gelu" in gemm.fused_activations:
                hidden = gemm.linear_activation(x, *layer["up"], "gelu")
            else:
                hidden = torch.nn.functional.gelu(gemm.linear(x, *layer["up"]))
            x = ops.add_layer_norm(gemm.linear(hidden, *layer["down"]), x, *layer["out_norm"], eps)
        if output_rows is not None and not self.layers:
            x = x.index_select(0, output_rows)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head.

        Raises:
            NotImplementedError: always (the engine refuses generation requests before).
        """
        raise NotImplementedError(f"{self.config.architecture} has no LM head")


class BertForSequenceClassification(BertModel):
    """``BertForSequenceClassification`` (cross-encoders such as ms-marco MiniLM): the pooler's output on
    CLS, then ``classifier``."""

    prefix: ClassVar[str] = "bert."

    @classmethod
    def head_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """``classifier`` ``[labels, hidden]`` and its bias."""
        labels = len(config.hf_config.get("id2label") or {}) or int(config.hf_config.get("num_labels", 2))
        return {"classifier.weight": (labels, config.hidden_size), "classifier.bias": (labels,)}

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the classifier."""
        self.classifier = (tensors["classifier.weight"], tensors["classifier.bias"])

    def classification_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooler (dense + tanh) then classifier: float32 ``[labels]``."""
        assert self.pooler is not None
        x = torch.tanh(torch.nn.functional.linear(pooled.to(self.device, self.dtype), *self.pooler))
        return torch.nn.functional.linear(x, *self.classifier).float()


class XLMRobertaModel(BertModel):
    """``XLMRobertaModel`` (bge-m3, e5, gte-multilingual): BERT's layers, positions past the padding id."""

    @classmethod
    def position_offset(cls, hf_config: dict[str, Any]) -> int:
        """``padding_idx + 1``: XLM-RoBERTa numbers positions after its padding id."""
        return int(hf_config.get("pad_token_id", 1)) + 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """``XLMRobertaForSequenceClassification`` (bge-reranker): a dense + tanh + ``out_proj`` head on CLS,
    no BERT pooler."""

    prefix: ClassVar[str] = "roberta."
    has_pooler: ClassVar[bool] = False

    @classmethod
    def head_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """``classifier.dense`` and ``classifier.out_proj`` with their biases."""
        h = config.hidden_size
        labels = len(config.hf_config.get("id2label") or {}) or int(config.hf_config.get("num_labels", 2))
        return {
            "classifier.dense.weight": (h, h), "classifier.dense.bias": (h,),
            "classifier.out_proj.weight": (labels, h), "classifier.out_proj.bias": (labels,),
        }  # fmt: skip

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the head."""
        self.head_dense = (tensors["classifier.dense.weight"], tensors["classifier.dense.bias"])
        self.head_out = (tensors["classifier.out_proj.weight"], tensors["classifier.out_proj.bias"])

    def classification_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Dense + tanh + out_proj on CLS: float32 ``[labels]``."""
        x = torch.tanh(torch.nn.functional.linear(pooled.to(self.device, self.dtype), *self.head_dense))
        return torch.nn.functional.linear(x, *self.head_out).float()
