"""The GEMM contract: how a backend prepares weights at load time and multiplies by them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``QuantizedWeight.extra`` key and value marking a weight whose activations may take one FP8 term per row
ACTIVATIONS_KEY = "activations"
PER_TOKEN_ACTIVATIONS = "per_token"


@dataclass(slots=True)
class QuantizedWeight:
    """A weight still in a quantized storage format, as the loader found it.

    Attributes:
        scheme: the quantization scheme name, e.g. ``"gguf_q4_0"``, ``"gguf_q8_0"``, ``"fp8_e4m3"``.
        data: the raw storage (a tensor or bytes-like array); layout is the scheme's own.
        shape: the logical ``(out_features, in_features)`` shape.
        dequantize: callable returning the float32 ``[out, in]`` weight; every backend may fall back to it.
        extra: scheme-specific fields (scales, zero points, block sizes). ``extra["activations"] ==
            "per_token"`` marks a weight the engine quantized itself for speed (``quantization="fp8"``): the
            backend may then quantize activations to one term per row (W8A8) rather than its more
            accurate default; ignoring the mark is correct, only slower.
    """

    scheme: str
    data: Any
    shape: tuple[int, int]
    dequantize: Any
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RowQuantizedActivations:
    """Activations already quantized to one FP8 term per row, in the form a W8A8 weight consumes.

    An op that produces a GEMM's input (a norm, the SwiGLU product) can write this directly when the
    backend asks for it (:meth:`GemmBackend.row_quantized_input`), saving the GEMM a pass over the
    activations to quantize them.

    Attributes:
        data: ``[rows, in_features]`` FP8 values.
        scale: float32 ``[rows, 1]``: row ``i`` stands for ``data[i] * scale[i]``.
        dtype: the activation dtype the product returns (what the unquantized input's dtype was).
    """

    data: Any
    scale: Any
    dtype: Any


class GemmBackend(ABC):
    """Dense and quantized matrix multiplication ``y = x @ W.T + b``."""

    #: quantization schemes whose weights :meth:`prepare_weight` keeps quantized
    supported_quant_schemes: frozenset[str] = frozenset()
    #: the gated activations (``"silu"``, ``"gelu_tanh"``) :meth:`gated_linear` runs; the core calls it
    #: only for these and otherwise runs :meth:`linear` and the op table's activation
    gated_activations: frozenset[str] = frozenset()
    #: the activations (``"gelu"``: GELU with erf) :meth:`linear_activation` applies to the product before
    #: writing it; the core calls it only for these and otherwise runs :meth:`linear` and the activation
    fused_activations: frozenset[str] = frozenset()
    #: whether :meth:`add_rms_norm_linear` takes a layer's residual add and RMS norm into the product that
    #: reads them; the core calls it only then and otherwise runs the op table's norm and :meth:`linear`
    fuses_residual_norm: bool = False
    #: whether :meth:`add_rms_norm_router` takes the residual add and RMS norm before a mixture of experts into
    #: its router's product; the core calls it only then and otherwise runs the op table's norm and :meth:`linear`
    fuses_router_norm: bool = False

    @abstractmethod
    def prepare_weight(self, weight: Any, dtype: Any) -> Any:
        """Turn a loaded weight into the form :meth:`linear` consumes (packing, casting, moving to device).

        Called once per weight at load time.

        Args:
            weight: a float tensor ``[out_features, in_features]`` or a :class:`QuantizedWeight`.
            dtype: the activation dtype the model runs in.

        Returns:
            An opaque prepared weight.

        Raises:
            ValueError: for a quantization scheme this backend cannot run or dequantize.
        """

    @abstractmethod
    def linear(self, x: Any, weight: Any, bias: Any | None = None) -> Any:
        """Compute ``x @ W.T + bias``.

        Args:
            x: ``[..., in_features]`` activations.
            weight: a weight returned by :meth:`prepare_weight`.
            bias: optional ``[out_features]``.

        Returns:
            ``[..., out_features]`` in ``x``'s dtype.
        """

    def gated_linear(self, x: Any, weight: Any, activation: str) -> Any:
        """The gated MLP's input projection and activation in one: ``act(x @ G.T) * (x @ U.T)``, where
        ``weight`` stacks the gate's rows ``G`` over the up projection's rows ``U`` (``[2 * d, in]``).

        A backend fuses the activation into the product where that saves a pass over the ``2 * d``
        outputs (a single-row GEMV streams both halves and writes only ``d`` values); the core calls
        this only for the activations in :attr:`gated_activations`.

        Args:
            x: ``[..., in_features]`` activations (or a :class:`RowQuantizedActivations` for a weight
                whose :meth:`row_quantized_input` asks for one).
            weight: a weight returned by :meth:`prepare_weight`, ``2 * d`` output features.
            activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU with the tanh GELU).

        Returns:
            ``[..., d]`` in the activations' dtype.

        Raises:
            ValueError: for an activation not in :attr:`gated_activations`.
        """
        raise ValueError(
            f"{type(self).__name__} does not fuse gated activations (asked for {activation!r}); "
            "the core runs linear() and the activation op instead"
        )

    def linear_activation(self, x: Any, weight: Any, bias: Any | None, activation: str) -> Any:
        """``act(x @ W.T + bias)`` in one pass: the activation applied to the product's float32 accumulator
        before the output is rounded and written (a BERT MLP's up projection: one write of ``[rows, 4h]``
        instead of a write, a read and a write). The core calls this only for :attr:`fused_activations`.

        Args:
            x: ``[..., in_features]`` activations.
            weight: a weight returned by :meth:`prepare_weight`.
            bias: optional ``[out_features]``.
            activation: ``"gelu"`` (exact, with erf).

        Returns:
            ``[..., out_features]`` in ``x``'s dtype.

        Raises:
            ValueError: for an activation not in :attr:`fused_activations`.
        """
        raise ValueError(
            f"{type(self).__name__} does not fuse activations into linear (asked for {activation!r}); "
            "the core runs linear() and the activation op instead"
        )

    def add_rms_norm_linear(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, weight: Any, bias: Any | None = None,
        activation: str | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        """A layer's residual add and RMS norm with the product that reads them: ``s = x + residual`` (rounded to
        the activations' dtype, as the op table's ``fused_add_rms_norm`` rounds it), ``n = rms_norm(s) *
        norm_weight``, then ``n @ W.T + bias``, or with ``activation`` :meth:`gated_linear`'s ``act(n @ G.T) *
        (n @ U.T)``.

        Why: at batch 1 the norm is a launch of its own between two products, and its time is latency, not
        bytes. A single-row GEMV whose programs each read the whole row anyway can sum and normalise it
        themselves. The core calls this only where :attr:`fuses_residual_norm` is set, for products whose
        input nothing else reads (no adapter, one weight); a backend runs the norm and the product one after
        the other where its kernel does not take them.

        Args:
            x: ``[rows, hidden]``, the branch's output.
            residual: ``[rows, hidden]``, the residual stream (not written).
            norm_weight: ``[hidden]``, the norm's scale as the op table's norms take it.
            eps: the norm's epsilon.
            weight: a weight returned by :meth:`prepare_weight`.
            bias: optional ``[out_features]`` (None with ``activation``).
            activation: None for the plain product, else one of :attr:`gated_activations`.

        Returns:
            ``(product, s)``: the product (``[rows, out_features]``, or ``[rows, out_features / 2]`` gated)
            and the new residual stream ``s``, both in ``x``'s dtype.

        Raises:
            ValueError: where the backend does not fuse the norm, or for an activation it does not gate.
        """
        raise ValueError(
            f"{type(self).__name__} does not fuse the residual norm into its products; "
            "the core runs fused_add_rms_norm and linear() instead"
        )

    def add_rms_norm_router(
        self, x: Any, residual: Any, norm_weight: Any, eps: float, router: Any, bias: Any | None = None
    ) -> tuple[Any, Any, Any]:
        """A mixture of experts' residual add and RMS norm with its router's product: ``s = x + residual`` and
        ``n = rms_norm(s) * norm_weight`` as :meth:`add_rms_norm_linear` computes them, then ``n @ router.T +
        bias``; unlike there, ``n`` is returned too, since the experts read it after the router.

        Why: at batch 1 the norm is a launch of its own between the attention's output projection and the
        router, and its time is latency. The router is a small product (experts x hidden) of a few programs,
        so each can sum and normalise the row itself for little. The core calls this only where
        :attr:`fuses_router_norm` is set (an RMS norm, no adapter); a backend runs the norm and the product one
        after the other where its kernel does not take them.

        Args:
            x: ``[rows, hidden]``, the attention branch's output.
            residual: ``[rows, hidden]``, the residual stream (not written).
            norm_weight: ``[hidden]``, the norm's scale as the op table's norms take it.
            eps: the norm's epsilon.
            router: the router matrix ``[experts, hidden]`` as :meth:`prepare_weight` returned it.
            bias: optional ``[experts]``.

        Returns:
            ``(logits, n, s)``: the router's logits ``[rows, experts]``, the normalised rows and the new residual
            stream, all in ``x``'s dtype.

        Raises:
            ValueError: where the backend does not fuse the norm into the router.
        """
        raise ValueError(
            f"{type(self).__name__} does not fuse the residual norm into the router; "
            "the core runs fused_add_rms_norm and linear() instead"
        )

    def join_row_blocks(self, parts: Sequence[Any], rows: Sequence[int]) -> Any | None:
        """One weight for a fused projection (q/k/v, gate/up) whose parts were quantized in different schemes and
        so prepared one by one: GGUF Q4_K_M stores q and k in Q4_K and v in Q6_K in half its layers.

        Why: kept apart, such a projection is a product a block, and at batch 1 each is a launch whose time is
        latency more than bytes. A backend that can run the blocks' products as one (a kernel whose programs take
        either block's form) returns a weight that :meth:`linear`, :meth:`gated_linear`,
        :meth:`add_rms_norm_linear` and :meth:`add_lora` take as the stacked projection. The default, None,
        keeps the blocks apart: the core then runs a product a block.

        Args:
            parts: each block as :meth:`prepare_weight` returned it, in output order.
            rows: each block's output features.

        Returns:
            The joined weight (``[..., sum(rows)]`` products), or None.
        """
        return None

    def row_quantized_input(self, weight: Any) -> Any | None:
        """The FP8 dtype in which :meth:`linear` takes this weight's activations pre-quantized per row.

        The default, None, means :meth:`linear` takes plain activations only. A backend that returns a
        dtype must accept a :class:`RowQuantizedActivations` of that dtype as ``x`` for this weight.

        Args:
            weight: a weight returned by :meth:`prepare_weight`.

        Returns:
            A torch FP8 dtype, or None.
        """
        return None

    def logits(self, x: Any, weight: Any) -> Any:
        """float32 ``x @ W.T`` for the output projection (the vocabulary logits).

        The default rounds through :meth:`linear`'s dtype and casts; a backend that can write float32
        directly overrides this, so that bf16 rounding does not turn near-tied tokens into exact ties.

        Args:
            x: ``[rows, in_features]`` activations.
            weight: a weight returned by :meth:`prepare_weight`.

        Returns:
            float32 ``[rows, out_features]``.
        """
        return self.linear(x, weight).float()

    def prepare_experts(
        self, gate_up: list[Any], down: list[Any], dtype: Any, gate_up_bias: list[Any] | None = None,
        down_bias: list[Any] | None = None,
    ) -> Any:  # fmt: skip
        """Turn a mixture-of-experts layer's expert weights into the form :meth:`fused_moe` consumes.

        Called once per MoE layer at load time. The default prepares each matrix with
        :meth:`prepare_weight` (quantized experts stay quantized where that keeps them); a backend with a
        grouped-GEMM kernel stacks them instead.

        Args:
            gate_up: per expert, ``[2 * intermediate, hidden]`` (the gate's rows, then the up
                projection's): a float tensor or a :class:`QuantizedWeight`.
            down: per expert, ``[hidden, intermediate]``.
            dtype: the activation dtype the model runs in.
            gate_up_bias: per expert ``[2 * intermediate]`` tensors (gpt-oss) on the model's device, in the
                model dtype, or None.
            down_bias: per expert ``[hidden]``, likewise, or None.

        Returns:
            Opaque experts (the default: :class:`engine.interfaces.moe.ExpertWeights`).

        Raises:
            ValueError: for a quantization scheme this backend cannot run or dequantize.
        """
        from engine.interfaces.moe import ExpertWeights

        return ExpertWeights(
            [self.prepare_weight(w, dtype) for w in gate_up], [self.prepare_weight(w, dtype) for w in down],
            gate_up_bias, down_bias,
        )

    def fused_moe(self, x: Any, experts: Any, topk_weights: Any, topk_ids: Any, activation: str = "silu") -> Any:
        """Run each token through its chosen experts and combine them: ``y[t] = sum_j topk_weights[t, j] *
        down_e(silu(gate_e x[t]) * up_e x[t])`` with ``e = topk_ids[t, j]``.

        The default runs :meth:`linear` once per projection of each expert that has tokens
        (:func:`engine.interfaces.moe.reference_fused_moe`); a backend overrides it with a grouped GEMM.

        Args:
            x: ``[tokens, hidden]`` activations.
            experts: from :meth:`prepare_experts`.
            topk_weights: float32 ``[tokens, k]``.
            topk_ids: int64 ``[tokens, k]``; an expert may get no token, a token may name one expert twice.
            activation: the experts' gated activation (``"silu"``, or gpt-oss's ``"swigluoai"``; see
                :func:`engine.interfaces.moe.expert_activation`).

        Returns:
            ``[tokens, hidden]`` in ``x``'s dtype.

        Raises:
            ValueError: for an activation the backend does not run.
        """
        from engine.interfaces.moe import reference_fused_moe

        return reference_fused_moe(self, x, experts, topk_weights, topk_ids, activation)

    def plan_lora(self, step: Any) -> Any:
        """Prepare a step's adapter rows once for every :meth:`add_lora` of that step.

        The default groups the rows by slot on the host
        (:func:`engine.interfaces.lora.group_lora_rows`); a backend that records steps into graphs
        overrides it with a plan built from ``step.token_slots`` alone (``token_slots_cpu`` is None
        while recording).

        Args:
            step: a :class:`engine.interfaces.lora.LoraStep`.

        Returns:
            An opaque plan handed to :meth:`add_lora` (the default's may be None: no row has an adapter).
        """
        from engine.interfaces.lora import group_lora_rows

        return group_lora_rows(step)

    def add_lora(self, y: Any, x: Any, weights: Any, plan: Any) -> None:
        """Add each row's adapter update to a projection's output, in place:
        ``y[t] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for ``s = token_slots[t] >= 0``.

        Args:
            y: ``[rows, out_features]``, the projection's output (any float dtype, float32 logits too).
            x: ``[rows, in_features]``, the projection's input, in the model dtype.
            weights: the projection's :class:`engine.interfaces.lora.LoraWeights`.
            plan: from :meth:`plan_lora` for this step's rows.
        """
        from engine.interfaces.lora import grouped_add_lora

        grouped_add_lora(y, x, weights, plan)
