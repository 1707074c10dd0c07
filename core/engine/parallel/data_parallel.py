"""Data parallelism: ``data_parallel_size`` engine replicas, each in its own process, behind the one
add / step / abort interface of :class:`engine.llm_engine.LLMEngine`.

Each replica is a whole engine (:mod:`engine.parallel.replica`) on its own devices (replica ``i`` drives
the host's devices ``i * world_size`` on, ``world_size`` being its tensor- or pipeline-parallel ranks).
The driver routes each request to one replica (:class:`PrefixAwareRouter`: the longest cached prefix,
else the least loaded) and lets every replica with work step freely: a step call returns the outputs
of whichever replicas have finished a step and starts their next one at once, so a slow replica never
holds a fast one back.
"""

from __future__ import annotations

import logging
import multiprocessing
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.parallel.mp_workers import LOAD_TIMEOUT_S, WorkerFailed, exit_reason, stop_processes
from engine.parallel.prefix_router import PrefixAwareRouter
from engine.parallel.replica import ReplicaInfo, StepReply, rebuild_error

logger = logging.getLogger(__name__)


class _Replica:
    """The driver's view of one replica: its pipe, whether a step of it is running, the replies read
    ahead while waiting for another answer, and its latest counters."""

    def __init__(self, index: int, process: Any, pipe: Connection) -> None:
        self.index = index
        self.process = process
        self.pipe = pipe
        self.info: ReplicaInfo | None = None
        self.in_step = False
        self.has_work = False
        self.replies: list[tuple[str, Any]] = []
        self.num_free_blocks = 0
        self.stats: dict[str, int | float] = {}

    def send(self, kind: str, payload: Any = None) -> None:
        try:
            self.pipe.send((kind, payload))
        except (BrokenPipeError, EOFError, OSError):
            raise WorkerFailed(self._exit_reason()) from None

    def receive(self) -> tuple[str, Any]:
        try:
            kind, payload = self.pipe.recv()
        except (EOFError, OSError):
            raise WorkerFailed(self._exit_reason()) from None
        if kind == "error":
            raise WorkerFailed(payload)
        return kind, payload

    def answer(self, expected: str) -> Any:
        """Read until the answer to the request just sent; step replies met first are kept for
        :meth:`DataParallelEngine.step`.

        Raises:
            WorkerFailed: the replica exited.
            InvalidRequestError, QueueFullError: the replica refused the request.
        """
        while True:
            kind, payload = self.receive()
            if kind in ("stepped", "failed"):
                self.in_step = False
                self.replies.append((kind, payload))
                continue
            if kind == "refused":
                raise rebuild_error(payload)
            if kind != expected:
                raise WorkerFailed(f"data-parallel replica {self.index} said {kind!r}, expected {expected!r}")
            return payload

    def _exit_reason(self) -> str:
        return exit_reason(self.process, f"data-parallel replica {self.index}")


class DataParallelEngine:
    """Replicas of one engine behind :class:`LLMEngine`'s interface (what ``LLM`` and the server use).

    Not thread-safe, like :class:`LLMEngine`: one thread adds, aborts and steps.

    Args:
        config: the engine configuration (``parallel.data_parallel_size`` replicas).
        replicas: the started replicas, each ready.
        tokenizer: the model's tokenizer, for the server's chat templates and for routing.
    """

    def __init__(self, config: EngineConfig, replicas: list[_Replica], tokenizer: Any) -> None:
        from engine.input_processor import InputProcessor

        info = replicas[0].info
        assert info is not None
        self.config = config
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.max_model_len = min(r.info.max_model_len for r in replicas if r.info is not None)
        self.model_name = info.model_name
        self.model_path = info.model_path
        self.generation_defaults = info.generation_defaults
        self.router = PrefixAwareRouter([r.info.num_total_blocks for r in replicas if r.info], info.block_size)
        self._tokens = InputProcessor(tokenizer, info.vocab_size, self.max_model_len)
        #: request id -> the replica that runs it
        self._owner: dict[str, int] = {}
        self._finalizer = weakref.finalize(
            self, stop_processes, [r.process for r in replicas], [r.pipe for r in replicas], []
        )

    @classmethod
    def start(cls, config: EngineConfig) -> DataParallelEngine:
        """Check the configuration here, start the replicas and wait until each has built its engine.

        Raises:
            EngineConfigError: the configuration cannot run on this platform (found before any replica starts).
            WorkerFailed: a replica failed to build its engine (its reason) or exited.
        """
        from engine.engine_setup import EngineConfigError, resolve_model
        from engine.loader import load_tokenizer
        from engine.plugins.manager import PluginManager
        from engine.plugins.selection import select_platform

        parallel = config.parallel
        if parallel.distributed_executor_backend == "ray" and parallel.world_size > 1:
            raise EngineConfigError(
                "data parallelism with replicas of several Ray-executed ranks is not implemented yet "
                "(use distributed_executor_backend 'mp')"
            )
        manager = PluginManager()
        platform = select_platform(config.device, manager)
        _, model_path, _, _, _ = resolve_model(config, platform, manager)
        size = config.parallel.data_parallel_size
        context = multiprocessing.get_context("spawn")
        replicas: list[_Replica] = []
        try:
            for index in range(size):
                parallel = config.parallel.model_copy(update={"data_parallel_rank": index})
                # the replicas draw unseeded randomness from streams of their own
                replica_config = config.model_copy(update={"parallel": parallel, "seed": config.seed + index})
                parent, child = context.Pipe()
                process = context.Process(
                    target=_replica_entry, args=(replica_config.to_process_json(), index, size, child),
                    name=f"engine-dp-replica{index}",
                )  # fmt: skip
                process.start()
                child.close()
                replicas.append(_Replica(index, process, parent))
            logger.info("started %d data-parallel replicas", size)
            tokenizer = load_tokenizer(config.tokenizer or model_path)
            for replica in replicas:
                if not replica.pipe.poll(LOAD_TIMEOUT_S):
                    raise WorkerFailed(f"data-parallel replica {replica.index} did not load within {LOAD_TIMEOUT_S:.0f} s")
                replica.info = replica.answer("ready")
                replica.num_free_blocks = replica.info.num_total_blocks
        except BaseException:
            stop_processes([r.process for r in replicas], [r.pipe for r in replicas], [])
            raise
        return cls(config, replicas, tokenizer)

    def shutdown(self) -> None:
        """Stop every replica (and its own ranks) and wait for them; safe to call twice."""
        self._finalizer()

    # --- requests ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return sum(r.num_free_blocks for r in self.replicas)

    @property
    def num_total_blocks(self) -> int:
        return sum(r.info.num_total_blocks for r in self.replicas if r.info is not None)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_work or r.in_step or r.replies for r in self.replicas)

    def validate_request(self, prompt: str | list[int], params: Any, cache_salt: str | None = None) -> list[int]:
        """Check a request as a replica would, without queueing it (see :meth:`LLMEngine.validate_request`)."""
        replica = self.replicas[min(range(len(self.replicas)), key=lambda i: self.router.load[i])]
        replica.send("validate", (prompt, params, cache_salt))
        return list(replica.answer("validated"))

    def tokenize_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids, the texts encoded in one batch (see :meth:`LLMEngine.tokenize_prompts`)."""
        return self._tokens.tokenize_many(prompts)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: Any,
        priority: int = 0,
        final_only: bool = False,
        cache_salt: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request on the replica the router picks (see :meth:`LLMEngine.add_request`); the
        replica re-checks ``prompt_token_ids`` rather than tokenizing the text again.

        Raises:
            InvalidRequestError: the replica refused it, or ``request_id`` is in use.
            QueueFullError: that replica's waiting queue is full.
        """
        from engine.errors import InvalidRequestError

        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self._tokens.tokenize(prompt) if prompt_token_ids is None else prompt_token_ids
        index = self.router.choose(token_ids, cache_salt)
        replica = self.replicas[index]
        options: dict[str, Any] = {"priority": priority, "final_only": final_only, "cache_salt": cache_salt}
        if prompt_token_ids is not None:
            options["prompt_token_ids"] = prompt_token_ids
        try:
            replica.send("add", (request_id, prompt, params, options))
            replica.answer("added")
        except BaseException:
            self.router.finished(index)
            raise
        self._owner[request_id] = index
        replica.has_work = True

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now on their replicas; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            index = self._owner.pop(rid, None)
            if index is not None:
                self.router.finished(index)
                by_replica.setdefault(index, []).append(rid)
        for index, rids in by_replica.items():
            self.replicas[index].send("abort", rids)

    # --- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """The outputs of every replica step that has ended since the last call, waiting for one if none
        has; each replica with work left starts its next step at once.

        Raises:
            RuntimeError: a replica's step failed (its message); that replica goes on.
            WorkerFailed: a replica exited; the engine cannot go on.
        """
        for replica in self.replicas:
            if replica.has_work and not replica.in_step:
                replica.send("step")
                replica.in_step = True
        if not any(r.replies for r in self.replicas):
            running = [r.pipe for r in self.replicas if r.in_step]
            if not running:
                return []
            wait(running)
        for replica in self.replicas:
            while replica.in_step and replica.pipe.poll():
                kind, payload = replica.receive()
                replica.in_step = False
                replica.replies.append((kind, payload))
        outputs: list[RequestOutput] = []
        failures: list[str] = []
        for replica in self.replicas:
            replies, replica.replies = replica.replies, []
            for kind, payload in replies:
                if kind == "failed":
                    failures.append(f"data-parallel replica {replica.index}: {payload}")
                    continue
                outputs.extend(self._took(replica, payload))
            if replica.has_work and not replica.in_step:
                replica.send("step")
                replica.in_step = True
        if failures:
            raise RuntimeError("; ".join(failures))
        return outputs

    def _took(self, replica: _Replica, reply: StepReply) -> list[RequestOutput]:
        replica.has_work = reply.has_unfinished
        replica.num_free_blocks = reply.num_free_blocks
        replica.stats = reply.stats
        outputs = []
        for out in reply.outputs:
            if out.request_id not in self._owner:
                continue  # aborted while this step ran
            outputs.append(out)
            if out.finished:
                del self._owner[out.request_id]
                self.router.finished(replica.index)
        return outputs

    def stats(self) -> dict[str, int | float | str]:
        """The replicas' counters added up (rates and usage recomputed over the sums; a label, such as the
        speculation method, as every replica gives it)."""
        total: dict[str, int | float | str] = {}
        for replica in self.replicas:
            for key, value in replica.stats.items():
                total[key] = value if isinstance(value, str) else total.get(key, 0) + value  # type: ignore[operator]
        sums = {k: v for k, v in total.items() if not isinstance(v, str)}
        queried = sums.get("prefix_cache_queried_tokens", 0)
        if "prefix_cache_hit_rate" in total:
            total["prefix_cache_hit_rate"] = round(sums.get("prefix_cache_hit_tokens", 0) / queried, 4) if queried else 0.0
        proposed, accepted = sums.get("spec_num_proposed_tokens", 0), sums.get("spec_num_accepted_tokens", 0)
        steps = sums.get("spec_num_verified_steps", 0)
        if "spec_acceptance_rate" in total:
            total["spec_acceptance_rate"] = round(accepted / proposed, 4) if proposed else 0.0
        if "spec_mean_accepted_length" in total:
            total["spec_mean_accepted_length"] = round((accepted + steps) / steps, 4) if steps else 0.0
        if "kv_cache_usage" in total:
            total["kv_cache_usage"] = round(1.0 - self.num_free_blocks / max(1, self.num_total_blocks), 4)
        total["num_free_blocks"] = self.num_free_blocks
        total["num_total_blocks"] = self.num_total_blocks
        return total


def _replica_entry(config_json: str, index: int, size: int, pipe: Connection) -> None:
    from engine.parallel.replica import run_replica

    run_replica(config_json, index, size, pipe)


__all__ = ["DataParallelEngine"]
