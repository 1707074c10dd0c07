"""The engine's side of pooling requests: queueing one, ending its sequence once its prompt is computed,
and handing out its output once the step's reductions reach the host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.outputs import PoolingRequestOutput
from engine.pooling.params import PoolingParams
from engine.pooling.pooler import PooledStep
from engine.pooling.validation import check_per_token_params
from engine.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.lora.engine_adapters import EngineLoras
    from engine.pooling.requests import PoolingRequests
    from engine.sampling.params import SamplingParams


class PoolingSteps:
    """Mixed into :class:`~engine.llm_engine.LLMEngine`: the pooling requests' admission and outputs."""

    config: EngineConfig
    model: Any
    model_config: Any
    pooling: PoolingRequests
    loras: EngineLoras
    scheduler: Any
    requests: dict[str, Request]
    _pooling_step_params: SamplingParams
    _pooled_in_flight: PooledStep | None
    _seq_ids: Any
    _arrivals: Any

    if TYPE_CHECKING:  # the engine's own methods, which these call

        def validate_request(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None) -> list[int]: ...

        def _admit(self, count: int, what: str) -> None: ...

    def _add_pooling(
        self, request_id: str, prompt: str | list[int], params: PoolingParams, priority: int, cache_salt: str | None,
        lora_request: LoRARequest | None = None, prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a pooling request: one sequence whose prompt is computed and pooled, nothing sampled."""
        hidden = self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise InvalidRequestError(f"dimensions {params.dimensions} exceeds the model's {hidden}", param="dimensions")
        if params.task == "classify" and self.pooling.head is None:
            raise InvalidRequestError(f"{self.model_config.architecture} has no classification head (classify, score and rerank need a sequence-classification model)")
        check_per_token_params(params, hidden, self.model_config.hf_config)
        if params.pooling_type is None:  # the model's own, resolved now: a step reads which rows it pools
            params = params.model_copy(update={"pooling_type": self.pooling.defaults.pooling_type})
        source = prompt if prompt_token_ids is None else prompt_token_ids
        step_params = self._pooling_step_params
        token_ids = self.validate_request(source, step_params, cache_salt)
        self._admit(1, "n")
        # generation settings the scheduler reads; the sequence ends once its prompt is pooled
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, step_params, final_only=True)
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=request_id, index=0, prompt_token_ids=token_ids,
            params=request.params, arrival=next(self._arrivals), priority=priority, cache_salt=cache_salt,
        )  # fmt: skip
        seq.pooling = params
        self.loras.tag([seq], lora_request)
        if getattr(self.model, "needs_whole_prompt", False):
            budget = self.config.scheduler.max_num_batched_tokens
            if budget is not None and len(token_ids) > budget:
                raise InvalidRequestError(
                    f"the prompt has {len(token_ids)} tokens; {self.model_config.architecture} computes a prompt in one step, and a step holds max_num_batched_tokens={budget}"
                )
            seq.whole_prompt = True
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.pooling.add(request_id, params)
        self.scheduler.add(seq)

    def _end_pooled(self, pooled: PooledStep) -> None:
        """End the sequences whose prompt this step finished. Their blocks are free for the next step at
        once (the device runs the steps in order); their outputs wait for the step's reductions."""
        for seq in pooled.ending():
            seq.status = SequenceStatus.FINISHED
            self.scheduler.remove(seq)

    def _read_pooled(self, pooled: PooledStep | None) -> list[PoolingRequestOutput]:
        """The outputs of the pooling requests the step before finished, read from the host now; ``pooled``
        (this step's chunks) is read by the next call, while the device runs the next step, or now
        without async scheduling."""
        if self.config.scheduler.async_scheduling:
            pooled, self._pooled_in_flight = self._pooled_in_flight, pooled
        if pooled is None:
            return []
        outputs = []
        for seq, output in self.pooling.take(pooled.chunks()):
            self.requests.pop(seq.request_id, None)
            outputs.append(output)
        return outputs
