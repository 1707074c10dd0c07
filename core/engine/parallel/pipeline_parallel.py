"""Pipeline parallelism: the layers split into stages, one rank each, activations passed down the line.

Stage 0 (the driver) embeds the tokens and runs its layers, each later stage receives the hidden states
and the residual stream from the one before and runs its own, and the last applies the final norm and the
lm_head and sends the logits back to stage 0, which samples. A step runs in micro-batches
(:mod:`engine.parallel.micro_batches`), so the stages work on different parts of it at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.interfaces.communicator import Communicator


def stage_layers(num_layers: int, size: int, stage: int) -> range:
    """The layers of ``stage`` out of ``size``: contiguous, the earlier stages one longer when they do not
    divide evenly."""
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's stage.

    Attributes:
        stage: this rank's stage (its rank in the pipeline group).
        size: stages.
        comm: the pipeline group's communicator.
        layers: the model's layers this stage runs.
    """

    stage: int
    size: int
    comm: Communicator
    layers: range

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand this stage's output to the next one (the residual crosses in float32)."""
        self.comm.send(hidden.contiguous(), self.stage + 1)
        self.comm.send(residual.float().contiguous(), self.stage + 1)

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual stream, ``[num_tokens, hidden_size]`` each."""
        hidden = self.comm.recv(torch.empty(num_tokens, hidden_size, dtype=dtype, device=device), self.stage - 1)
        residual = self.comm.recv(torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=device), self.stage - 1)
        return hidden, residual.to(dtype)

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's logits to stage 0, which samples."""
        self.comm.send(logits.float().contiguous(), 0)

    def recv_logits(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Stage 0: the last stage's float32 logits ``[rows, vocab]``."""
        return self.comm.recv(torch.empty(rows, vocab, dtype=torch.float32, device=device), self.size - 1)


def pipeline_parallel_problems(num_layers: int, size: int, mixed_windows: bool, post_norms: bool) -> list[str]:
    """Why a model cannot be split into ``size`` stages (empty when it can)."""
    problems = []
    if num_layers < size:
        problems.append(f"{num_layers} layers do not fill pipeline_parallel_size {size} stages")
    if mixed_windows:
        problems.append("layers with different attention windows (KV groups) do not run pipeline-parallel yet")
    if post_norms:
        problems.append("post-norm models (Gemma 2/3, GLM-4) do not run pipeline-parallel yet")
    return problems
