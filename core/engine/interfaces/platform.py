"""The platform contract: what a hardware plugin says about its device and the backends it builds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.interfaces.attention import AttentionBackend
from engine.interfaces.block_cache import BlockCache, KVCacheSpec
from engine.interfaces.gemm import GemmBackend
from engine.interfaces.graph_capture import EagerGraphCapture, GraphCapture
from engine.interfaces.step_overlap import StepOverlap

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.interfaces.communicator import Communicator
    from engine.interfaces.model_runner import PlatformModelRunner
    from engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class DetectResult:
    """The outcome of :meth:`Platform.detect`: available or not, and why not."""

    available: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a platform claims; the conformance suite tests every claim and ``validate`` rejects the rest.

    Attributes:
        dtypes: model dtypes by name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        kv_cache_dtypes: KV cache dtypes by name.
        block_sizes: tokens per KV block.
        head_sizes: attention head dimensions.
        quant_schemes: weight quantization schemes the GEMM runs (beyond dequantizing at load).
        graph_capture: whether :meth:`Platform.make_graph_capture` records real graphs.
        sliding_window: whether attention honours ``sliding_window``.
        logits_soft_cap: whether attention honours ``logits_soft_cap``.
        attention_sinks: whether attention honours ``AttentionMetadata.sinks`` (gpt-oss).
        non_causal_attention: whether attention honours ``AttentionMetadata.causal=False`` (every query
            token sees its sequence's whole context, later positions included) in steps where every
            sequence's whole context is its query: no cached prefix, the prompt computed in one step, as
            encoder models (BERT, XLM-RoBERTa embedders and rerankers) run. Nothing is claimed for a
            non-causal step over a cached prefix.
        non_causal_sliding_window: whether attention honours ``sliding_window`` in such a non-causal step
            as a symmetric window (key j visible to query i iff ``|i - j| < sliding_window``, see
            :class:`~engine.interfaces.attention.AttentionMetadata`): ModernBERT's local layers. A backend
            that does not claim it must refuse such a step (ValueError), never run it one-sided.
        swap: whether the block cache can swap blocks to host memory.
        warm_up: whether kernels compile on first use (per batch kind or launch shape), so the engine
            should run a few dummy steps at start-up to compile them before the first request.
        distributed: whether :meth:`Platform.make_communicator` builds communicators (tensor, pipeline
            and expert parallelism need them).
        lora: whether the GEMM backend's :meth:`GemmBackend.plan_lora` / :meth:`GemmBackend.add_lora`
            run batched LoRA adapters (``enable_lora``), inside recorded graphs too where the platform
            records them.
        graph_capture_collectives: with ``graph_capture``, whether the graphs may hold the communicator's
            collectives (tensor parallelism's all-reduce and all-gather), so that every tensor-parallel
            rank records and replays its decode graphs in lockstep. Claim it only where a collective
            launched while recording is recorded into the graph (no host synchronisation, no allocation
            outside the graph's memory) and replays as the same collective; without it a tensor-parallel
            engine runs eagerly.
        graph_capture_verify: with ``graph_capture``, whether steps whose rows bring several tokens each
            (speculative verification: each sequence's last token and its proposals, at most
            ``k + 1``) may be recorded too: the attention backend then runs a recorded step's rows from
            the device tensors alone (``AttentionMetadata.graph_capture``; its host lists describe the
            bucket: every row ``k + 1`` tokens). Without it verification steps run eagerly.
        graph_capture_prefill: with ``graph_capture``, whether a step of one sequence's prompt chunk (up to
            512 tokens, over any cached prefix) may be recorded too, padded to a token bucket
            (:mod:`engine.prefill_graphs`): the attention backend then runs it from the device tensors
            alone (``AttentionMetadata.graph_capture``; its host lists describe the bucket: one row of
            the bucket's tokens over a context of the model's length). Without it such steps run eagerly.
    """

    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("float32",)
    block_sizes: tuple[int, ...] = (16,)
    head_sizes: tuple[int, ...] = (64, 128)
    quant_schemes: tuple[str, ...] = ()
    graph_capture: bool = False
    sliding_window: bool = False
    logits_soft_cap: bool = False
    attention_sinks: bool = False
    non_causal_attention: bool = False
    non_causal_sliding_window: bool = False
    swap: bool = False
    warm_up: bool = False
    distributed: bool = False
    lora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    graph_capture_collectives: bool = False
    graph_capture_verify: bool = False
    graph_capture_prefill: bool = False
    step_overlap: bool = False


class Platform(ABC):
    """One kind of device, as a plugin presents it to the core.

    Class attributes:
        name: the device name users pass to ``--device`` (``"cpu"``, ``"cuda"``, ...).
        aliases: other names that select this platform.
        priority: higher wins when ``--device auto`` finds several available platforms.
        torch_device_type: the torch device type tensors live on (``"cpu"``, ``"cuda"``), if torch-based.
        ray_device_resource: the Ray resource one device of this platform counts as (``"GPU"``), which the
            Ray executor reserves for each rank; None when a rank needs only a CPU.
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    priority: int = 0
    torch_device_type: str = "cpu"
    ray_device_resource: str | None = None

    @classmethod
    @abstractmethod
    def detect(cls) -> DetectResult:
        """Whether this device is usable here. Must be cheap and must not initialise the device.

        Returns:
            A :class:`DetectResult`; when unavailable, ``reason`` says why in one sentence.
        """

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """The features this platform claims."""

    def validate(self, config: EngineConfig) -> list[str]:
        """Reasons ``config`` cannot run here; empty if it can.

        The default checks dtype, KV dtype, block size against :meth:`capabilities`; override to add
        checks (head size is checked by the engine once the model config is known).
        """
        caps = self.capabilities()
        reasons = []
        if config.dtype not in caps.dtypes:
            reasons.append(f"dtype {config.dtype!r} is not supported on {self.name} (supported: {list(caps.dtypes)})")
        kv = config.cache.kv_cache_dtype or config.dtype
        if kv not in caps.kv_cache_dtypes:
            reasons.append(
                f"KV cache dtype {kv!r} is not supported on {self.name} (supported: {list(caps.kv_cache_dtypes)})"
            )
        if config.cache.block_size not in caps.block_sizes:
            reasons.append(
                f"block size {config.cache.block_size} is not supported on {self.name} "
                f"(supported: {list(caps.block_sizes)})"
            )
        return reasons

    @abstractmethod
    def total_memory_bytes(self) -> int:
        """Device memory in bytes."""

    @abstractmethod
    def free_memory_bytes(self) -> int:
        """Device memory currently free, in bytes."""

    def torch_device(self) -> Any:
        """The torch device model tensors go to."""
        import torch

        return torch.device(self.torch_device_type)

    def use_device(self, local_rank: int) -> None:
        """Drive the host's device ``local_rank`` from now on (:meth:`torch_device` returns it): a parallel
        rank's or a data-parallel replica's own device. Called once, before anything is built.

        The default suits a platform of one device per host, which only has device 0.

        Args:
            local_rank: the device's index among this host's devices of this platform.

        Raises:
            RuntimeError: the host has no such device.
        """
        if local_rank != 0:
            raise RuntimeError(f"{self.name} drives one device per host; there is no device {local_rank}")

    def default_kv_cache_bytes(self) -> int | None:
        """KV budget when the user gives none; None means a fraction of free memory.

        Host-memory platforms return a fixed size so that an engine does not claim half of the RAM it
        shares with everything else.
        """
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (for timing). No-op by default."""
        return None

    def element_size(self, dtype: Any) -> int:
        """Bytes per element of a cache dtype."""
        import torch

        return torch.empty((), dtype=dtype).element_size()

    @abstractmethod
    def make_attention_backend(self) -> AttentionBackend:
        """The attention backend for this device."""

    @abstractmethod
    def make_gemm_backend(self) -> GemmBackend:
        """The GEMM backend for this device."""

    @abstractmethod
    def make_block_cache(self, spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend) -> BlockCache:
        """Allocate the KV pool once.

        Args:
            spec: the cache geometry.
            num_blocks: physical blocks to allocate (the engine sized it from the memory budget).
            attention: the backend whose :meth:`AttentionBackend.kv_cache_shape` fixes each layer's layout.
        """

    def make_graph_capture(self) -> GraphCapture:
        """The graph capture for decode steps; eager unless the platform overrides it."""
        return EagerGraphCapture()

    def make_step_overlap(self) -> StepOverlap:
        """The two lanes of an overlapped step (claim ``step_overlap``).

        Raises:
            NotImplementedError: the platform does not claim ``step_overlap``.
        """
        raise NotImplementedError(f"platform {self.name!r} runs no overlapped steps (it does not claim 'step_overlap')")

    def make_model_runner(self, model_config: ModelConfig, dtype: str) -> PlatformModelRunner | None:
        """A runner for the whole forward on this device, or None to run the core's torch model on the
        backends above (the default).

        Args:
            model_config: the model's sizes and architecture.
            dtype: the resolved model dtype name (``"float32"``, ``"bfloat16"``, ...).

        Raises:
            ValueError: if the platform runs models itself but not this architecture.
        """
        return None

    def make_communicator(self, world_size: int, rank: int, init_method: str, local_rank: int = 0) -> Communicator:
        """This process's communicator in a group of ``world_size`` ranks (claim ``distributed``).

        Args:
            world_size: ranks in the group.
            rank: this process's rank.
            init_method: the rendezvous every rank of the group passes, e.g. ``"tcp://127.0.0.1:29500"``.
            local_rank: this process's index among the ranks on its host (which device it drives).

        Raises:
            NotImplementedError: the platform does not claim ``distributed``.
            RuntimeError: the group cannot be formed (the message says why).
        """
        raise NotImplementedError(f"platform {self.name!r} has no communicator (it does not claim 'distributed')")

    def op_overrides(self) -> dict[str, Callable[..., Any]]:
        """Ops (by name, see :mod:`engine.interfaces.ops`) this platform implements itself."""
        return {}

    def default_max_num_batched_tokens(self) -> int | None:
        """The step token budget the engine uses when the user sets none (``max_num_batched_tokens``).

        Returns:
            Tokens a step, or None for the core's default (2048), which suits a device whose prefill
            rate a few thousand tokens already reach (a CPU); a large GPU's needs larger steps (fewer,
            fuller steps under load). Encoder models, whose step is whole prompts, take their own.
        """
        return None

    def default_encoder_step_tokens(self) -> int | None:
        """The step token budget of encoder-only models (embeddings, cross-encoders) when the user sets none.

        An encoder's step is whole prompts and nothing decodes, so its best size is the device's own.

        Returns:
            Tokens a step, or None for the core's default (32768), which suits a large GPU: fewer, fuller
            steps spread the per-step host work. The engine raises it to the model's context length, so
            that any prompt fits one step.
        """
        return None

    def seed(self, seed: int) -> None:
        """Seed the device's random generators."""
        import torch

        torch.manual_seed(seed)
