"""The model base class: what the loader asks of an architecture, and what the engine calls on a model.

Every architecture, the core's and a plugin's, is a :class:`CausalLM` subclass registered under its
Hugging Face ``architectures`` name (see :mod:`engine.models.registry`). The loader never knows a
tensor name itself: it asks the resolved class for the checkpoint's names and shapes, the dummy
initialisation, the tensors to skip and the GGUF mapping.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from engine.interfaces.attention import AttentionBackend, AttentionMetadata
from engine.interfaces.gemm import GemmBackend, QuantizedWeight
from engine.interfaces.ops import OpTable
from engine.models.config import ModelConfig

# llama.cpp names per-layer tensors ``blk.<layer>.<name>`` for every architecture
_GGUF_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class CausalLM(ABC):
    """A decoder-only language model written against the plugin interfaces.

    Subclasses implement :meth:`weight_shapes`, :meth:`load_weights`, :meth:`forward` and
    :meth:`compute_logits`, and call ``super().__init__``; the other class-level hooks have defaults
    that fit most HF checkpoints. The engine reads ``scale`` and sets ``linear_quantizer`` on instances.

    Args:
        config: the model's sizes (built by :meth:`config_from_hf` or the GGUF loader).
        ops: the op table (reference ops with the platform's overrides).
        attention: the platform's attention backend.
        gemm: the platform's GEMM backend.
        dtype: activation and weight dtype.
        device: where tensors live.
    """

    #: GGUF ``general.architecture`` value -> the HF architecture name it loads as; empty: no GGUF files.
    #: A kind with ``:experts`` after it (``"llama:experts"``) is that kind's files that hold experts
    #: (``<kind>.expert_count`` above 0), which llama.cpp writes under the dense kind's name (Mixtral)
    gguf_architectures: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: llama.cpp's global tensor names -> HF names (used by the default :meth:`gguf_tensor_name`)
    gguf_global_tensor_names: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: llama.cpp's per-layer names (after ``blk.<i>.``) -> HF names (after :attr:`hf_layer_prefix`); a HF
    #: name with ``{}`` stands for a 3-D tensor of stacked experts, which the loader yields one expert at a
    #: time with the expert's index in the braces; names joined by ``+`` are one tensor's equal runs of rows
    #: (a fused gate/up), cut apart at load
    gguf_layer_tensor_names: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: the HF name prefix of layer ``i``, formatted with ``i``
    hf_layer_prefix: ClassVar[str] = "model.layers.{}."
    #: suffixes of checkpoint tensors the model recomputes (buffers, not parameters); the loader skips them
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    #: :meth:`forward` takes ``output_rows`` (int64, the step's rows whose final hidden states are read,
    #: one per pooled prompt) and then returns only those rows, skipping the last layer's work past its
    #: attention for the others (a pooling step that reads each prompt's CLS or last row)
    prunes_to_output_rows: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        ops: OpTable,
        attention: AttentionBackend,
        gemm: GemmBackend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.ops = ops
        self.attention = attention
        self.gemm = gemm
        self.dtype = dtype
        self.device = device
        #: the softmax scale the runner puts in every step's ``AttentionMetadata``; override for
        #: architectures that scale attention otherwise
        self.scale = config.head_dim**-0.5
        #: applied to each dense layer projection at load (``quantization="fp8"``): tensor -> QuantizedWeight.
        #: A model that cannot take quantized projections leaves it unused; never apply it to the
        #: embedding or the LM head (their values pick the tokens).
        self.linear_quantizer: Callable[[torch.Tensor], QuantizedWeight] | None = None

    # --- what the loader asks of the class ----------------------------------------------------------

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """Build the model config from a parsed HF ``config.json``.

        The default reads the Llama-family keys (:meth:`ModelConfig.from_hf_dict`); an architecture with
        other key names overrides this. The raw dict is kept as ``ModelConfig.hf_config`` either way.

        Args:
            hf_config: the parsed ``config.json``.

        Returns:
            The model config.

        Raises:
            KeyError: a required key is missing.
            TypeError, ValueError: a value has the wrong type.
        """
        return ModelConfig.from_hf_dict(hf_config)

    @classmethod
    @abstractmethod
    def weight_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of ``config`` must provide, by HF name, in the checkpoint's order.

        The loader checks a checkpoint against it (unexpected, missing, repeated or misshapen tensors
        fail) and draws dummy weights from it, so it must match :meth:`load_weights` exactly.

        Args:
            config: the model config.

        Returns:
            HF tensor name -> shape in HF orientation (``[out_features, in_features]`` for linears).
        """

    @classmethod
    def is_norm_scale(cls, name: str) -> bool:
        """Whether dummy weights draw ``name`` around 1 (a norm's scale) rather than around 0.

        Args:
            name: a name from :meth:`weight_shapes`.

        Returns:
            True for norm scales; the default matches names ending in ``norm.weight``.
        """
        return name.endswith("norm.weight")

    @classmethod
    def ignores_weight(cls, name: str, config: ModelConfig) -> bool:
        """Whether the loader drops checkpoint tensor ``name`` before checking the stream.

        Args:
            name: a tensor name found in a checkpoint.
            config: the model config.

        Returns:
            True for recomputed buffers (:attr:`ignored_weight_suffixes`) and similar extras.
        """
        return name.endswith(cls.ignored_weight_suffixes)

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str) -> str | None:
        """Map a llama.cpp tensor name to the HF name :meth:`weight_shapes` uses.

        The default looks ``gguf_name`` up in :attr:`gguf_global_tensor_names`, then, for
        ``blk.<i>.<name>``, ``<name>`` in :attr:`gguf_layer_tensor_names` under :attr:`hf_layer_prefix`.

        Args:
            gguf_name: the tensor's name in the GGUF file.

        Returns:
            The HF name, or None for a tensor the model does not keep.

        Raises:
            KeyError: a name this architecture does not know.
        """
        if gguf_name in cls.gguf_global_tensor_names:
            return cls.gguf_global_tensor_names[gguf_name]
        match = _GGUF_LAYER_NAME.match(gguf_name)
        if match and match.group(2) in cls.gguf_layer_tensor_names:
            prefix = cls.hf_layer_prefix.format(match.group(1))
            return "+".join(prefix + name for name in cls.gguf_layer_tensor_names[match.group(2)].split("+"))
        raise KeyError(gguf_name)

    @classmethod
    def gguf_permuted_heads(cls, gguf_architecture: str, name: str, config: ModelConfig) -> int:
        """How many heads llama.cpp's converter permuted the rows of tensor ``name`` within, or 0.

        llama.cpp's converter interleaves the two rotary halves of each head of some architectures' Q/K
        projections; the GGUF loader undoes it for the heads returned here.

        Args:
            gguf_architecture: the file's ``general.architecture``.
            name: the tensor's HF name.
            config: the model config.

        Returns:
            The number of heads the rows split into, or 0 to keep the rows as stored (the default).
        """
        return 0

    @classmethod
    def gguf_restore(
        cls, gguf_architecture: str, name: str, weight: torch.Tensor | QuantizedWeight, config: ModelConfig
    ) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Undo the value changes llama.cpp's converter made to one tensor (after renaming and rows).

        Some converters change values (Gemma stores norm scales as ``1 + w``) or merge HF tensors into one
        (StableLM stacks its per-head q/k norm scales); the GGUF loader calls this on every tensor.

        Args:
            gguf_architecture: the file's ``general.architecture``.
            name: the tensor's HF name (from :meth:`gguf_tensor_name`).
            weight: the tensor, Q/K rows already in HF order.
            config: the model config.

        Returns:
            The HF tensors it stands for; the default keeps ``(name, weight)`` as it is.
        """
        return [(name, weight)]

    @classmethod
    def required_features(cls, config: ModelConfig) -> dict[str, str]:
        """Attention features the model needs from the platform.

        The engine refuses the model, with a one-line reason, on a platform whose
        :class:`~engine.interfaces.platform.Capabilities` does not claim each one.

        Args:
            config: the model config.

        Returns:
            ``Capabilities`` field name (``sliding_window``, ``logits_soft_cap``) -> the feature's name in
            messages; the default asks only for a sliding window when the config sets one.
        """
        return {"sliding_window": "sliding-window attention"} if config.sliding_window else {}

    @classmethod
    def parallel_problems(
        cls, config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel: bool
    ) -> list[str]:
        """Why ``config`` cannot be split across ranks this way, known before any rank process starts.

        The engine asks before it starts the ranks, so that a model that cannot split is refused at once;
        the default knows of no problem (a model that splits nothing is refused once built).

        Args:
            config: the model config.
            tensor_parallel_size: ranks sharing each layer (1: none).
            pipeline_parallel_size: stages of consecutive layers (1: none).
            expert_parallel: experts divided among the tensor-parallel ranks instead of sliced.

        Returns:
            Every reason, empty when the split is possible.
        """
        return []

    # --- what the engine calls on an instance -------------------------------------------------------

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Take the checkpoint's tensors (HF names, as :meth:`weight_shapes` lists them) and keep them.

        Matrices go through ``self.gemm.prepare_weight``; a :class:`QuantizedWeight` arrives only for
        schemes the GEMM backend claims.

        Args:
            weights: (HF name, tensor) pairs, already checked against :meth:`weight_shapes`.

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run a flat batch of tokens (prefills, prefill chunks and decodes mixed).

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``, each token's position in its sequence.
            kv_caches: one cache per layer, as the platform's block cache holds them.
            metadata: the batch description, passed to every attention call unchanged.

        Returns:
            Hidden states ``[num_tokens, hidden]`` after the final norm.
        """

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden rows to the vocabulary.

        Args:
            hidden: ``[rows, hidden]`` rows of :meth:`forward`'s output.

        Returns:
            float32 logits ``[rows, vocab_size]``.
        """
