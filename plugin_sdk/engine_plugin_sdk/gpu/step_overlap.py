"""Dual-batch overlap on a GPU: the attention lane is a second torch stream (CUDA, or HIP under ROCm).

The compute lane is whatever stream the step was issued on (the recording stream inside a graph), so the
same calls fork and join a graph's branches while it is recorded and two streams' queues when it runs
eagerly. Each hand-over is an event wait, and every tensor one lane reads from the other is marked as
used by the reading stream (``Tensor.record_stream``), so that the allocator does not hand its memory to
the producing stream's next allocation while the reader still needs it.

Two kernels on two streams share the GPU only where the first leaves room: a matrix product that fills
every SM leaves the attention kernel none until its last wave drains. ``attention_sms`` asks the BLAS
library's products (cuBLASLt, through torch's SM carveout) to leave that many SMs free while an
overlapped step is queued, so that the attention of the other nano-batch always has some; 0 leaves the
products as they are and the streams interleave at wave boundaries only. ``attention_priority`` (a
negative number is higher) lets the attention stream's blocks take SMs as they free up before the
products' waiting blocks do.

Importing this module must stay cheap: torch is imported inside methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from engine.interfaces.step_overlap import Lane, StepOverlap


class TorchStreamStepOverlap(StepOverlap):
    """Two torch streams of one GPU as the lanes of an overlapped step.

    Args:
        device_index: the GPU whose streams these are.
        attention_sms: SMs the products leave to the attention lane while a step is queued (0: none).
        attention_priority: the attention stream's priority (0, the default streams'; negative: higher, to
            the limit the GPU has).

    Raises:
        ValueError: ``attention_sms`` is negative, or positive with a torch that cannot carve SMs out of its
            products.
    """

    def __init__(self, device_index: int, attention_sms: int = 0, attention_priority: int = 0) -> None:
        import torch

        if attention_sms < 0:
            raise ValueError(f"attention_sms must be >= 0, got {attention_sms}")
        if attention_sms and not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise ValueError(f"torch {torch.__version__} cannot leave SMs free from its matrix products (no SM carveout)")
        self.device_index = device_index
        self.attention_sms = attention_sms
        self.attention_priority = attention_priority
        self._attention_stream: Any = None
        self._compute_stream: Any = None
        #: (carveout, BLAS library) in force before :meth:`begin` changed them, restored by :meth:`end`
        self._saved: tuple[Any, Any] | None = None

    def begin(self) -> None:
        import torch

        if self._attention_stream is None:
            self._attention_stream = torch.cuda.Stream(device=self.device_index, priority=self.attention_priority)
        self._compute_stream = torch.cuda.current_stream(self.device_index)
        self._attention_stream.wait_stream(self._compute_stream)
        if self.attention_sms:
            # the carveout reaches cuBLASLt's products: route the plain ones there too for the step
            self._saved = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
            torch._C._set_sm_carveout_experimental(self.attention_sms)
            torch.backends.cuda.preferred_blas_library("cublaslt")

    def lane(self, lane: Lane) -> AbstractContextManager[None]:
        import torch

        if self._compute_stream is None:
            raise RuntimeError("lane() called outside begin() / end()")
        if lane is Lane.ATTENTION:
            return torch.cuda.stream(self._attention_stream)
        return nullcontext() if torch.cuda.current_stream(self.device_index) == self._compute_stream else torch.cuda.stream(self._compute_stream)

    def hand_over(self, to: Lane, tensors: Sequence[Any]) -> None:
        if self._compute_stream is None:
            raise RuntimeError("hand_over() called outside begin() / end()")
        reader, writer = (
            (self._attention_stream, self._compute_stream) if to is Lane.ATTENTION else (self._compute_stream, self._attention_stream)
        )
        reader.wait_stream(writer)
        for tensor in tensors:
            tensor.record_stream(reader)

    def end(self) -> None:
        import torch

        if self._compute_stream is None:
            raise RuntimeError("end() called without begin()")
        self._compute_stream.wait_stream(self._attention_stream)
        self._compute_stream = None
        if self._saved is not None:
            carveout, library = self._saved
            torch._C._set_sm_carveout_experimental(carveout)
            torch.backends.cuda.preferred_blas_library(library)
            self._saved = None
