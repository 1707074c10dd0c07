"""ModernBERT encoders for embeddings and reranking: ``ModernBertModel`` (gte-modernbert, modernbert-embed)
and ``ModernBertForSequenceClassification`` (ModernBERT rerankers and classifiers).

Token embeddings and a LayerNorm (no position table), pre-norm layers (layer 0 has no attention norm),
a fused ``Wqkv``, rotary positions with one base on global layers and another on local ones, a GeGLU MLP
(``Wi`` holds the activated input half, then the gate half) and a final norm; LayerNorms and linears
without biases unless the config asks. Every layer attends bidirectionally; a local layer (all but every
``global_attn_every_n_layers``-th, or as ``layer_types`` says) sees only ``|i - j| <= local_attention // 2``,
which the attention contract's symmetric non-causal window expresses as ``sliding_window =
local_attention // 2 + 1``. As for BERT, a prompt is computed whole in one step, for pooling only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from engine.loader.lazy_tensor import materialize
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.rotary import build_cos_sin_cache, rope_type
from engine.models.sequence_classification import num_labels
from engine.models.weights import take_tensor

GLOBAL, LOCAL = "full_attention", "sliding_attention"
#: HF's defaults for checkpoints that predate ``rope_parameters``
_DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}
_OLD_THETA_KEYS = {GLOBAL: "global_rope_theta", LOCAL: "local_rope_theta"}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


#: transformers' ACT2FN names the configs use -> the function
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.nn.functional.gelu, "gelu_python": torch.nn.functional.gelu,
    "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh, "gelu_fast": _gelu_tanh,
    "silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu, "relu": torch.relu,
}  # fmt: skip


def activation(hf_config: dict[str, Any], key: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``hf_config[key]`` names (``gelu``, the exact erf GELU, when unset).

    Raises:
        ValueError: an activation the engine does not implement, named.
    """
    name = str(hf_config.get(key) or "gelu")
    if name not in ACTIVATIONS:
        raise ValueError(f"{key} {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each layer's kind: ``layer_types`` (transformers >= 5), else every ``global_attn_every_n_layers``-th
    layer global, starting with layer 0, the rest local."""
    types = hf_config.get("layer_types")
    if types:
        return [str(t) for t in types]
    every = int(hf_config.get("global_attn_every_n_layers") or 3)
    return [LOCAL if i % every else GLOBAL for i in range(int(hf_config["num_hidden_layers"]))]


def rope_parameters(hf_config: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """The rotary base and scaling of one layer kind, from ``rope_parameters[kind]`` or the older
    ``global_rope_theta`` / ``local_rope_theta`` keys (scaling None for plain RoPE)."""
    params = dict((hf_config.get("rope_parameters") or {}).get(kind) or {})
    theta = params.get("rope_theta") or hf_config.get(_OLD_THETA_KEYS[kind]) or _DEFAULT_THETA[kind]
    return float(theta), params if rope_type(params) != "default" else None


class ModernBertModel(CausalLM):
    """``ModernBertModel``: the encoder whose final-normed hidden states are pooled (CLS unless its
    sentence-transformers files say otherwise)."""

    generates: ClassVar[bool] = False
    #: a classifier's instances follow ``classifier_pooling`` instead
    default_pooling_type: str = "CLS"
    #: bidirectional attention: a prompt is computed in one step
    needs_whole_prompt: ClassVar[bool] = True
    #: a CLS-pooled step computes the last layer's output and MLP for the CLS rows only
    prunes_to_output_rows: ClassVar[bool] = True
    #: the tensor names' prefix (``model.`` in a classifier's checkpoint)
    prefix: ClassVar[str] = ""

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """The encoder's sizes; the local window lives in the layers, not in ``sliding_window`` (the engine
        keeps every block of a prompt computed in one step).

        Raises:
            ValueError: an activation or layer kind the engine does not implement.
        """
        config = ModelConfig.from_hf_dict(hf_config)
        config.rms_norm_eps = float(hf_config.get("norm_eps", 1e-5))
        config.attention_bias = bool(hf_config.get("attention_bias", False))
        config.sliding_window = None
        config.tie_word_embeddings = True
        activation(hf_config, "hidden_activation")
        unknown = sorted(set(layer_types(hf_config)) - {GLOBAL, LOCAL})
        if unknown:
            raise ValueError(f"ModernBERT layer types {unknown} are not supported (supported: {GLOBAL}, {LOCAL})")
        return config

    @classmethod
    def local_window(cls, config: ModelConfig) -> int:
        """The contract's symmetric window of a local layer: HF's ``|i - j| <= local_attention // 2``."""
        return int(config.hf_config.get("local_attention", 128)) // 2 + 1

    @classmethod
    def required_features(cls, config: ModelConfig) -> dict[str, str]:
        """Bidirectional attention, and its symmetric window when some layer is local."""
        needs = {"non_causal_attention": "bidirectional (encoder) attention"}
        if LOCAL in layer_types(config.hf_config):
            needs["non_causal_sliding_window"] = "bidirectional sliding-window (local) attention"
        return needs

    @classmethod
    def head_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The classification head's tensors (none for the bare encoder)."""
        return {}

    @classmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Embeddings, layers, final norm and head, by HF name (biases only where the config has them)."""
        hf, h, inter, p = config.hf_config, config.hidden_size, config.intermediate_size, cls.prefix
        norm_bias, mlp_bias = bool(hf.get("norm_bias", False)), bool(hf.get("mlp_bias", False))
        shapes: dict[str, tuple[int, ...]] = {p + "embeddings.tok_embeddings.weight": (config.vocab_size, h)}

        def add(name: str, rows: int, cols: int | None, bias: bool) -> None:
            shapes[name + ".weight"] = (rows, cols) if cols is not None else (rows,)
            if bias:
                shapes[name + ".bias"] = (rows,)

        add(p + "embeddings.norm", h, None, norm_bias)
        for i in range(config.num_layers):
            layer = f"{p}layers.{i}."
            if i:  # layer 0 normalizes nothing before attention: the embeddings were just normed
                add(layer + "attn_norm", h, None, norm_bias)
            add(layer + "attn.Wqkv", 3 * config.num_heads * config.head_dim, h, config.attention_bias)
            add(layer + "attn.Wo", h, config.num_heads * config.head_dim, config.attention_bias)
            add(layer + "mlp_norm", h, None, norm_bias)
            add(layer + "mlp.Wi", 2 * inter, h, mlp_bias)
            add(layer + "mlp.Wo", h, inter, mlp_bias)
        add(p + "final_norm", h, None, norm_bias)
        shapes.update(cls.head_shapes(config))
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take every tensor in the model dtype, projections through the GEMM backend."""
        tensors = dict(weights)
        shapes = self.weight_shapes(self.config)
        dev, dt, gemm = self.device, self.dtype, self.gemm

        def take(name: str) -> torch.Tensor | None:
            if name not in shapes:
                return None
            return torch.as_tensor(materialize(take_tensor(tensors, name, shapes[name]))).to(device=dev, dtype=dt)

        def norm(name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return take(name + ".weight"), take(name + ".bias")

        def linear(name: str) -> tuple[Any, torch.Tensor | None]:
            weight = take(name + ".weight")
            assert weight is not None
            return gemm.prepare_weight(weight, dt), take(name + ".bias")

        p = self.prefix
        self.embeddings = take(p + "embeddings.tok_embeddings.weight")
        self.embed_norm = norm(p + "embeddings.norm")
        kinds = layer_types(self.config.hf_config)
        self.layers: list[dict[str, Any]] = []
        for i in range(self.config.num_layers):
            layer = f"{p}layers.{i}."
            self.layers.append({
                "kind": kinds[i], "attn_norm": norm(layer + "attn_norm") if i else None,
                "qkv": linear(layer + "attn.Wqkv"), "o": linear(layer + "attn.Wo"),
                "mlp_norm": norm(layer + "mlp_norm"), "wi": linear(layer + "mlp.Wi"), "wo": linear(layer + "mlp.Wo"),
            })  # fmt: skip
        self.final_norm = norm(p + "final_norm")
        self.act = activation(self.config.hf_config, "hidden_activation")
        self.rope_tables = {kind: self._rope_table(kind) for kind in set(kinds)}
        self.load_head({n: t for n in self.head_shapes(self.config) if (t := take(n)) is not None})

    def _rope_table(self, kind: str) -> torch.Tensor:
        theta, scaling = rope_parameters(self.config.hf_config, kind)
        max_position = self.config.max_position_embeddings
        return build_cos_sin_cache(self.config.head_dim, max_position, theta, scaling, self.device)

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the classification head's tensors (none for the bare encoder)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[tokens, hidden]`` of whole prompts (one step each); with
        ``output_rows``, only those rows: the last layer attends from every row and takes only these past
        its attention."""
        ops, gemm, eps = self.ops, self.gemm, self.config.rms_norm_eps
        # one metadata copy per layer kind, each with its own extras, so a backend's per-step plan is built
        # once per kind rather than rebuilt whenever the window changes between layers
        windows = {GLOBAL: None, LOCAL: self.local_window(self.config)}
        metas = {
            kind: dataclasses.replace(metadata, causal=False, sliding_window=windows[kind], extras={})
            for kind in self.rope_tables
        }
        x = ops.layer_norm(self.embeddings.index_select(0, input_ids), *self.embed_norm, eps)
        heads, d = self.config.num_heads, self.config.head_dim
        shape = (x.shape[0], heads, d)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            h = x if layer["attn_norm"] is None else ops.layer_norm(x, *layer["attn_norm"], eps)
            q, k, v = gemm.linear(h, *layer["qkv"]).split(heads * d, dim=-1)
            table = self.rope_tables[layer["kind"]]
            q, k = ops.rotary_embedding(positions, q.reshape(shape), k.reshape(shape), table)
            attn = self.attention.forward(q, k, v.reshape(shape), cache, metas[layer["kind"]])
            attn = attn.reshape(x.shape[0], heads * d)
            if i == last and output_rows is not None:
                attn, x = attn.index_select(0, output_rows), x.index_select(0, output_rows)
            x = x + gemm.linear(attn, *layer["o"])
            inputs, gate = gemm.linear(ops.layer_norm(x, *layer["mlp_norm"], eps), *layer["wi"]).chunk(2, dim=-1)
            x = x + gemm.linear(self.act(inputs) * gate, *layer["wo"])
        if output_rows is not None and not self.layers:
            x = x.index_select(0, output_rows)
        return ops.layer_norm(x, *self.final_norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head.

        Raises:
            NotImplementedError: always (the engine refuses generation requests before).
        """
        raise NotImplementedError(f"{self.config.architecture} has no LM head")


class ModernBertForSequenceClassification(ModernBertModel):
    """``ModernBertForSequenceClassification``: the CLS row or the mean of all rows (``classifier_pooling``),
    then ``head`` (dense, activation, norm) and ``classifier``."""

    prefix: ClassVar[str] = "model."

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.default_pooling_type = "MEAN" if config.hf_config.get("classifier_pooling") == "mean" else "CLS"

    @classmethod
    def head_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """``head.dense`` (biased with ``classifier_bias``), ``head.norm`` and ``classifier`` ``[labels, hidden]``."""
        hf, h = config.hf_config, config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"head.dense.weight": (h, h), "head.norm.weight": (h,)}
        if hf.get("classifier_bias", False):
            shapes["head.dense.bias"] = (h,)
        if hf.get("norm_bias", False):
            shapes["head.norm.bias"] = (h,)
        labels = num_labels(hf)
        return {**shapes, "classifier.weight": (labels, h), "classifier.bias": (labels,)}

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the head."""
        self.head_dense = (tensors["head.dense.weight"], tensors.get("head.dense.bias"))
        self.head_norm = (tensors["head.norm.weight"], tensors.get("head.norm.bias"))
        self.classifier = (tensors["classifier.weight"], tensors["classifier.bias"])
        self.head_act = activation(self.config.hf_config, "classifier_activation")

    def classification_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Dense, activation, LayerNorm, classifier on the pooled row: float32 ``[labels]``."""
        x = self.head_act(torch.nn.functional.linear(pooled.to(self.device, self.dtype), *self.head_dense))
        x = self.ops.layer_norm(x, *self.head_norm, self.config.rms_norm_eps)
        return torch.nn.functional.linear(x, *self.classifier).float()
